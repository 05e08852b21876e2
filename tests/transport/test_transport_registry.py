"""The transport registry and per-kind options: names from the entry-point group ``refit.transports``
(refit's own gloo / nccl / ipc, the example plugin's toy-tcp), in-process registration, unknown names named,
and a kind's options travelling typed through the settings' wire form and agreement."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from refit_toy.tcp import TCP, TcpOptions, TcpTransport

from refit_core import NcclOptions, RefitOptions, TransportKind
from refit_core.contract.errors import OptionError, PlanError
from refit_core.net.transport import open_transport, transport_names, transport_type
from refit_core.net.transport.registry import register_transport, unregister_transport
from refit_core.run.ipc import IPC, ColocatedPath
from refit_core.transports import TransportType


def test_refits_own_kinds_and_the_plugins_are_registered_through_entry_points():
    assert {"gloo", "nccl", "ipc", "toy-tcp"} <= set(transport_names())
    assert transport_type("toy-tcp") is TCP and transport_type("nccl").options is NcclOptions
    assert transport_type("ipc") is IPC and isinstance(IPC, ColocatedPath) and not IPC.network
    assert transport_type("gloo").network and transport_type("gloo").options is None


def test_an_unknown_name_is_an_option_error_naming_the_installed_transports():
    with pytest.raises(OptionError, match=r"no transport named 'nixl' is installed \(installed: gloo, ipc, nccl"):
        open_transport("nixl", dist.HashStore(), 0, 2, torch.device("cpu"), 5)


def test_the_colocated_path_is_no_network_transport():
    with pytest.raises(OptionError, match="transport 'ipc' is no network transport"):
        open_transport("ipc", dist.HashStore(), 0, 2, torch.device("cpu"), 5)


def test_a_kind_takes_only_its_own_options():
    with pytest.raises(OptionError, match="transport 'gloo' takes no options, but TcpOptions was given"):
        open_transport("gloo", dist.HashStore(), 0, 1, torch.device("cpu"), 5, TcpOptions())
    with pytest.raises(OptionError, match="transport 'toy-tcp' takes TcpOptions, not NcclOptions"):
        open_transport("toy-tcp", dist.HashStore(), 0, 1, torch.device("cpu"), 5, NcclOptions())


def test_register_transport_adds_a_kind_in_this_process_and_refuses_a_taken_name():
    calls = []
    kind = TransportType("test-local", lambda ctx: calls.append(ctx) or TcpTransport({}, 0, 5, TcpOptions(), None))
    register_transport(kind)
    try:
        assert transport_type("test-local") is kind and "test-local" in transport_names()
        transport = open_transport("test-local", dist.HashStore(), 0, 1, torch.device("cpu"), 5)
        assert calls[0].options is None and calls[0].world_size == 1
        transport.close()
        with pytest.raises(OptionError, match="'test-local' is registered already"):
            register_transport(kind)
        with pytest.raises(OptionError, match="'gloo' is registered already"):
            register_transport(TransportType("gloo", kind.open))
    finally:
        unregister_transport("test-local")
    assert "test-local" not in transport_names()


def test_transport_takes_any_well_formed_name_and_keeps_the_known_ones_as_members():
    assert RefitOptions(transport="gloo").transport is TransportKind.GLOO
    assert RefitOptions(transport="toy-tcp").transport == "toy-tcp"
    with pytest.raises(OptionError, match=r"RefitOptions.transport='Bad Name': expected a transport name"):
        RefitOptions(transport="Bad Name")


def test_a_third_party_kinds_options_travel_typed_through_the_wire_and_the_fingerprint():
    plain = RefitOptions(transport="toy-tcp")
    assert "transport_options" not in plain.agreed_wire()  # the fingerprints of every plan so far hold
    assert plain.digest() == RefitOptions(transport="toy-tcp", transport_options={}).digest()
    options = RefitOptions(transport="toy-tcp", transport_options={"toy-tcp": {"chunk_bytes": 4096}})
    assert options.options_for("toy-tcp") == TcpOptions(chunk_bytes=4096)
    assert options.options_for("nccl") is options.nccl and options.options_for("gloo") is None
    assert options.to_wire()["transport_options"] == {"toy-tcp": {"chunk_bytes": 4096, "nodelay": True}}
    assert RefitOptions.from_wire(options.to_wire()) == options
    assert options.agreed_wire()["transport_options"] and options.digest() != plain.digest()
    assert "transport_options" in options.explicit


def test_per_kind_options_are_checked_by_their_class_and_nccls_stay_in_their_own_field():
    with pytest.raises(OptionError, match="TcpOptions.chunk_bytes=0: expected a positive integer"):
        RefitOptions(transport_options={"toy-tcp": {"chunk_bytes": 0}})
    with pytest.raises(OptionError, match=r"NCCL's options are RefitOptions.nccl"):
        RefitOptions(transport_options={"nccl": {"comms_per_link": 2}})
    with pytest.raises(OptionError, match="no installed transport named 'nixl' has options"):
        RefitOptions(transport_options={"nixl": {"lanes": 2}})
    with pytest.raises(OptionError, match="options of 'toy-tcp' \\(TcpOptions\\) given for 'other'"):
        RefitOptions(transport_options={"other": TcpOptions()})


def test_both_sides_must_agree_on_a_kinds_options():
    published = RefitOptions(transport="toy-tcp", transport_options=[TcpOptions(chunk_bytes=4096)])
    assert RefitOptions().agree_with(published, "gen rank 0").options_for("toy-tcp") == TcpOptions(chunk_bytes=4096)
    mine = RefitOptions(transport_options={"toy-tcp": TcpOptions(nodelay=False)})
    with pytest.raises(PlanError, match="setting 'transport_options' disagrees: gen rank 0 set"):
        mine.agree_with(published, "gen rank 0")


def test_old_import_paths_still_import():
    from refit_core.contract.options import DEFAULT_CHOICE, NcclBackend, NcclChoice, _Settings  # noqa: F401
    from refit_core.net.transport.factory import open_transport as old_open, resolve_kind  # noqa: F401
    from refit_core.net.transport.nccl import NcclComm, TorchNcclComm, open_comm, resolve_backend  # noqa: F401

    assert old_open is open_transport


def test_every_settings_class_still_records_what_was_given_explicitly_after_the_split():
    from refit_core.contract.options import MessageOptions, RelayOptions, StoreLimits

    for settings, given in ((MessageOptions, {"zero_copy": False}), (NcclOptions, {"comms_per_link": 2}),
                            (RelayOptions, {"replicas": 4}), (StoreLimits, {"max_keys": 8}),
                            (RefitOptions, {"num_buffers": 2})):
        assert settings(**given).explicit == set(given), settings
