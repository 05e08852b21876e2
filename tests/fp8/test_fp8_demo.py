"""``refit demo --quantize fp8``: an FSDP2 trainer into a DTensor model holding transformers'
block-FP8 linear layers, every FP8 weight and scale checked against the reference quantizer."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_quantize_fp8_verifies_against_the_reference_quantizer():
    """The gen backend (dtensor, the one whose demo can hold FP8) and its single-rank layout are picked."""
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "dtensor", "--quantize", "fp8"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "14 block-FP8 (128, 128) weights checked against the reference quantizer" in out.stdout
    assert "-> dtensor(single, fp8)" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("verified OK")


def test_demo_refuses_fp8_for_a_backend_that_cannot_hold_it():
    out = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "toy", "--gen", "toy",
                          "--quantize", "fp8"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--quantize fp8: the toy backend's demo cannot hold quantized weights" in out.stdout + out.stderr
