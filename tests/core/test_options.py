"""RefitOptions: typed settings, their wire form, environment overrides, and agreement across ranks."""

import pytest
from settings_ranks import adopted_settings, mismatched_setups

from refit_core.contract.env import OVERRIDES, with_overrides
from refit_core.contract.errors import OptionError, PlanError
from refit_core.contract.options import (
    DEFAULT_CHOICE,
    CastPolicy,
    MessageMode,
    MessageOptions,
    NcclBackend,
    NcclChoice,
    NcclOptions,
    RefitOptions,
    TransportKind,
)
from refit_core.kit.launch import free_port, spawn


def test_strings_and_dicts_become_enums_and_nested_options():
    options = RefitOptions(cast="strict", transport="gloo", messages={"mode": "runs", "zero_copy": False},
                           nccl={"backend": "torch", "comms_per_link": 4})
    assert options.cast is CastPolicy.STRICT and options.transport is TransportKind.GLOO
    assert options.messages == MessageOptions(mode=MessageMode.RUNS, zero_copy=False)
    assert options.nccl == NcclOptions(backend=NcclBackend.TORCH, comms_per_link=4)
    assert options.explicit == {"cast", "transport", "messages.mode", "messages.zero_copy", "nccl.backend",
                                "nccl.comms_per_link"}
    assert RefitOptions().explicit == frozenset()


def test_the_nccl_communicators_the_settings_leave_open_take_the_default():
    assert NcclOptions().choice() == DEFAULT_CHOICE == NcclChoice(4, 0)
    assert NcclOptions(comms_per_link=3).choice() == NcclChoice(3, 0)
    assert NcclOptions(max_ctas=8).choice() == NcclChoice(4, 8)


def test_wire_form_is_plain_json_and_round_trips():
    import json

    options = RefitOptions(bucket_bytes=1 << 20, num_buffers=2, cast="strict", allow_unused_sources=True,
                           messages=MessageOptions(direct_min_bytes=4096), nccl=NcclOptions(comms_per_link=3))
    wire = json.loads(json.dumps(options.to_wire()))
    assert wire["cast"] == "strict" and wire["messages"]["direct_min_bytes"] == 4096
    assert RefitOptions.from_wire(wire) == options


@pytest.mark.parametrize(("wire", "named"), [
    ({"cast": "lenient"}, "RefitOptions.cast='lenient': use one of 'cast', 'strict'"),
    ({"num_buffers": "3"}, "RefitOptions.num_buffers='3': expected an integer"),
    ({"bucket_bytes": 1000}, "RefitOptions.bucket_bytes=1000: must be a positive multiple of 16"),
    ({"messages": {"mode": "chunks"}}, "MessageOptions.mode='chunks'"),
    ({"messages": {"zero_copy": 1}}, "MessageOptions.zero_copy=1: expected True or False"),
    ({"messages": {"shared_max_bytes": 100}}, "MessageOptions.shared_max_bytes=100: must be a positive multiple of 16"),
    ({"nccl": {"comms_per_link": 0}}, "NcclOptions.comms_per_link=0: must be >= 1"),
    ({"nccl": {"max_ctas": 64}}, "NcclOptions.max_ctas=64: must be 0 (NCCL's default) to 32"),
    ({"nccl": {"kind": "x"}}, "NcclOptions: unknown setting(s) ['kind']"),
    ({"buckets": 1}, "RefitOptions: unknown setting(s) ['buckets']"),
    ([1, 2], "RefitOptions: expected a dict of settings, got list"),
])
def test_bad_input_names_the_class_and_field(wire, named):
    with pytest.raises(OptionError) as info:
        RefitOptions.from_wire(wire)
    assert named in str(info.value)


def test_environment_overrides_are_explicit_settings():
    env = {"REFIT_NCCL_COMMS": "4", "REFIT_ZERO_COPY": "0", "REFIT_MESSAGES": "runs",
           "REFIT_DIRECT_MIN_BYTES": "1024", "REFIT_NCCL_BACKEND": "torch", "REFIT_JOB": "job-7",
           "REFIT_SECRET": "s3cret", "REFIT_INSECURE": "0"}
    options = with_overrides(RefitOptions(num_buffers=2), env)
    assert options.nccl == NcclOptions(backend="torch", comms_per_link=4)
    assert options.messages == MessageOptions(mode="runs", direct_min_bytes=1024, zero_copy=False)
    assert options.explicit == {"num_buffers", *(o.setting for o in OVERRIDES)}
    assert (options.job, options.secret, options.insecure) == ("job-7", "s3cret", False)
    assert "secret" not in options.to_wire()
    assert with_overrides(options, {}) is options
    with pytest.raises(OptionError, match=r"unknown setting\(s\) \['messages.zerocopy'\]"):
        options.overridden({"messages.zerocopy": False})


def test_an_override_of_a_setting_given_in_code_is_logged_without_showing_a_secret(caplog):
    """Programs that set their own secrets in code but inherit one REFIT_SECRET are one job: each is told."""
    env = {"REFIT_SECRET": "from-the-shell", "REFIT_NCCL_COMMS": "4", "REFIT_JOB": "same"}
    with caplog.at_level("WARNING", logger="refit"):
        options = with_overrides(RefitOptions(secret="in-code", nccl={"comms_per_link": 2}, job="same"), env)
    assert options.secret == "from-the-shell" and options.nccl.comms_per_link == 4
    assert [r.getMessage() for r in caplog.records] == [
        "refit: REFIT_NCCL_COMMS in the environment overrides nccl.comms_per_link set in code (2 in code, 4 from "
        "the environment)",
        "refit: REFIT_SECRET in the environment overrides secret set in code"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="refit"):
        with_overrides(RefitOptions(), env)  # nothing given in code: nothing replaced
    assert not caplog.records


@pytest.mark.parametrize(("env", "named"), [
    ({"REFIT_NCCL_COMMS": "two"}, "REFIT_NCCL_COMMS='two' (setting nccl.comms_per_link)"),
    ({"REFIT_ZERO_COPY": "maybe"}, "REFIT_ZERO_COPY='maybe' (setting messages.zero_copy)"),
    ({"REFIT_MESSAGES": "chunks"}, "MessageOptions.mode='chunks'"),
])
def test_bad_environment_values_name_the_variable(env, named):
    with pytest.raises(OptionError) as info:
        with_overrides(RefitOptions(), env)
    assert named in str(info.value)
    assert list(env)[0] in str(info.value)


def test_a_rank_adopts_what_it_did_not_set_and_keeps_its_own_timeout():
    published = RefitOptions(num_buffers=2, cast="strict", nccl={"comms_per_link": 4}).resolved("cpu")
    mine = RefitOptions(cast="strict", timeout_s=12)
    agreed = mine.agree_with(published, "gen rank 3")
    assert agreed.num_buffers == 2 and agreed.nccl.comms_per_link == 4 and agreed.bucket_bytes == 64 << 20
    assert published.timeout_s != 12 and agreed.timeout_s == 12
    with pytest.raises(PlanError, match=r"setting 'nccl.comms_per_link' disagrees: gen rank 3 set 2 but the "
                                        r"train side's rank 0 uses 4"):
        RefitOptions(nccl={"comms_per_link": 2}).agree_with(published, "gen rank 3")


def test_settings_are_part_of_the_plan_fingerprint():
    import torch

    from refit_core.contract.pieces import PieceMeta
    from refit_core.contract.spec import TensorSpec
    from refit_core.plan.reference import plan_transfers
    from refit_core.plan.schedule import build_schedule

    spec = TensorSpec("w", (4, 4), torch.float32)
    transfers = plan_transfers([[PieceMeta(spec, spec.full_box())]], [[PieceMeta(spec, spec.full_box())]])
    a = build_schedule(transfers, 1, 1, 1024, agreed_settings=RefitOptions().resolved("cpu").digest())
    b = build_schedule(transfers, 1, 1, 1024, agreed_settings=RefitOptions(num_buffers=2).resolved("cpu").digest())
    assert a.rounds == b.rounds and a.fingerprint != b.fingerprint
    # a setting added later keeps the fingerprints of plans that leave it at its default
    default = RefitOptions(messages={"shared_max_bytes": 64 << 20}).resolved("cpu").digest()
    assert default == RefitOptions().resolved("cpu").digest()
    assert RefitOptions(messages={"shared_max_bytes": 1 << 20}).resolved("cpu").digest() != default


# Every agreed setting, set on the gen side to a value other than the train side's.
MISMATCHES = [
    ("bucket_bytes", {"bucket_bytes": 4096}, {"bucket_bytes": 8192}, {}, "4096", "8192"),
    ("num_buffers", {}, {"num_buffers": 2}, {}, "3", "2"),
    ("cast", {}, {"cast": "strict"}, {}, "'cast'", "'strict'"),
    ("allow_unused_sources", {}, {"allow_unused_sources": True}, {}, "False", "True"),
    ("transport", {"transport": "gloo"}, {"transport": "auto"}, {}, "'gloo'", "'auto'"),
    ("messages.mode", {}, {"messages": {"mode": "runs"}}, {}, "'units'", "'runs'"),
    ("messages.direct_min_bytes", {}, {"messages": {"direct_min_bytes": 1024}}, {}, "16777216", "1024"),
    ("messages.zero_copy", {}, {"messages": {"zero_copy": False}}, {}, "True", "False"),
    ("nccl.backend", {}, {"nccl": {"backend": "torch"}}, {}, "'auto'", "'torch'"),
    ("nccl.comms_per_link", {"nccl": {"comms_per_link": 3}}, {"nccl": {"comms_per_link": 1}}, {}, "3", "1"),
    ("nccl.comms_per_link", {}, {}, {"REFIT_NCCL_COMMS": "4"}, "None", "4"),  # through the environment
    ("nccl.max_ctas", {}, {"nccl": {"max_ctas": 8}}, {}, "None", "8"),
]


def test_every_setting_set_differently_fails_setup_on_every_rank_naming_it():
    """One train rank and one gen rank go through every mismatch in turn; each setup fails on both
    ranks with a PlanError naming the setting and both values (no hang: each case has its deadline)."""
    cases = [(f"127.0.0.1:{free_port()}", {**train, "timeout_s": 30}, {**gen, "timeout_s": 30}, env)
             for _, train, gen, env, _, _ in MISMATCHES]
    train_results, gen_results = spawn(mismatched_setups, 2, cases, timeout_s=240)
    for (setting, *_, train_value, gen_value), train, gen in zip(MISMATCHES, train_results, gen_results):
        expected = (f"setting {setting!r} disagrees: gen rank 0 set {gen_value} but the train side's rank 0 "
                    f"uses {train_value}")
        for address, kind, message in (train, gen):
            assert kind == "PlanError", (setting, kind, message)
            assert expected in message, (setting, message)


def test_gen_side_adopts_the_train_sides_settings_and_refits_bitwise():
    train_options = {"bucket_bytes": 1024, "num_buffers": 2, "messages": {"zero_copy": False}, "timeout_s": 25}
    train, gen = spawn(adopted_settings, 2, f"127.0.0.1:{free_port()}", train_options, 20, timeout_s=180)
    assert train["settings"]["timeout_s"] == 25.0  # each side keeps its own timeout: a shared one fails here
    assert gen["settings"] == {**train["settings"], "timeout_s": 20.0}
    assert gen["settings"]["bucket_bytes"] == 1024 and gen["settings"]["messages"]["zero_copy"] is False
    assert gen["fingerprint"] == train["fingerprint"]
    assert gen["version"] == 7 and gen["mismatches"] == []
    assert gen["direct"] == 0 and 0 < gen["staging"] <= 2 * 1024  # zero-copy off, bucket and buffers adopted


def test_colocated_settings_are_each_ranks_own_and_typed():
    """``strided_copies``, ``overlap_check`` and ``step_trace`` change no byte that travels: a rank keeps
    its own value whatever the train side published, and they stay out of the plan's fingerprint."""
    from refit_core.contract.options import StridedCopy

    mine = RefitOptions(strided_copies="memcpy2d", overlap_check=True, step_trace=True)
    assert mine.strided_copies is StridedCopy.MEMCPY2D
    adopted = mine.agree_with(RefitOptions(num_buffers=2), "gen rank 1")
    assert (adopted.strided_copies, adopted.overlap_check, adopted.step_trace, adopted.num_buffers) == (
        StridedCopy.MEMCPY2D, True, True, 2)
    assert mine.resolved("cpu").digest() == RefitOptions().resolved("cpu").digest()
    with pytest.raises(OptionError, match="strided_copies"):
        RefitOptions(strided_copies="diagonal")


def test_bucket_bytes_are_checked_against_the_message_alignment():
    from refit_core.plan.items import ALIGN

    for ok in (ALIGN, 3 * ALIGN):
        assert RefitOptions(bucket_bytes=ok).bucket_bytes == ok
    for bad in [*range(1, ALIGN), *range(ALIGN + 1, 2 * ALIGN)]:
        with pytest.raises(OptionError, match=f"multiple of {ALIGN}"):
            RefitOptions(bucket_bytes=bad)
