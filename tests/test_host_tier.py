"""``--host-cache``: the second-level expert cache below the slot pools (experts/pool.py HostTier), on the CPU.

The same code serves a GPU's pools (pinned rows copied on the copy stream: tests/test_cuda.py); here the rows are
copied into host pools. Bars: the same bits as the resident store, misses the tier holds are not read from the
file again, the tier is refused when it cannot hold twice the pools' slots, and --mem's plan counts it.
"""

from __future__ import annotations

import pytest

from conftest import DEFAULT_GGUF
from helpers import assert_bitwise, assert_slots_hold_their_experts, cli, logits_of
from moestream.errors import ConfigError
from moestream.experts.pool import ResidentStore
from moestream.models.base import LoadOptions, load_model

IDS = [1, 5, 9, 200, 7, 3, 77, 12]


def test_identity_and_served_from_memory() -> None:
    model = load_model(str(DEFAULT_GGUF), LoadOptions(slots=4, host_cache=64 << 20))
    store = model.store
    first = logits_of(model, IDS, 6, 3)
    read_once, misses_once = store.bytes_read, store.stats.misses
    assert store.tier.misses > 0
    again = logits_of(model, IDS, 6, 3)  # the same experts: every pool miss is in the tier now
    assert store.stats.misses > misses_once  # the 4-slot pools did miss again ...
    assert store.bytes_read == read_once  # ... and nothing more came from the file
    assert store.tier.hits >= store.stats.misses - misses_once
    assert assert_slots_hold_their_experts(model, store) > 0
    model.set_store(ResidentStore(model.gguf, model.layout))
    ref = logits_of(model, IDS, 6, 3)
    assert_bitwise(first, ref)
    assert_bitwise(again, ref)


def test_without_the_tier_the_file_is_read_again() -> None:  # the control of the test above
    model = load_model(str(DEFAULT_GGUF), LoadOptions(slots=4))
    logits_of(model, IDS, 6, 3)
    once = model.store.bytes_read
    logits_of(model, IDS, 6, 3)
    assert model.store.bytes_read > once


def test_too_small_and_refused_combinations() -> None:
    with pytest.raises(ConfigError, match="fewer than twice"):
        load_model(str(DEFAULT_GGUF), LoadOptions(slots=32, host_cache=1 << 20))
    with pytest.raises(ConfigError, match="host_cache and prefetch on cannot be combined"):
        LoadOptions(host_cache=64 << 20, prefetch=True)


def test_cli_reports_it_and_the_plan_counts_it() -> None:
    r = cli("run", "-n", "8", "--temp", "0", "--slots", "4", "--host-cache", "64MiB")
    assert r.returncode == 0 and "host tier" in r.stderr and "pool misses copied from it" in r.stderr, r.stderr
    plain = cli("run", "-n", "8", "--temp", "0", "--slots", "4")
    assert plain.stdout == r.stdout
    m = cli("run", "-n", "4", "--mem", "20GiB", "--host-cache", "100MiB")  # in-process: the suite's RSS counts
    # the plan books what the tier holds: at most every expert (6.4 MiB in the default model), not 100 MiB
    assert m.returncode == 0 and "host tier 0.01" in m.stderr, m.stderr


def test_inspect_prices_it() -> None:
    r = cli("inspect", "--mem", "20GiB", "--host-cache", "100MiB")  # every expert: 6.4 MiB, what the tier holds
    assert r.returncode == 0 and "host tier     0.006 GiB (--host-cache)" in r.stdout, r.stdout + r.stderr
    bare = cli("inspect", "--mem", "20GiB")
    assert "host tier" not in bare.stdout
    lone = cli("inspect", "--host-cache", "100MiB")
    assert lone.returncode != 0 and "--mem" in lone.stderr


def test_verify_uses_it_and_does_not_call_it_ignored() -> None:
    """verify's resident pass loads the model with streaming off; the tier serves its streaming pass, so no note may
    say it is ignored (one did, above the line saying what the tier served)."""
    r = cli("verify", "--steps", "4", "--slots", "4", "--host-cache", "64MiB")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ignored" not in r.stderr and "host tier " in r.stdout, r.stdout + r.stderr
