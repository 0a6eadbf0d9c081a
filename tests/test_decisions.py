"""fusion_core.decisions: measured once per kind, one tie rule, stored per machine and software, reset in memory.

Each test has its own store (``FUSION_CORE_CACHE_DIR`` in ``tmp_path``) and counts the calls of the one seam that
times, ``Decisions.times``, which reports what the test says instead of a clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fusion_core
from fusion_core import cli, decisions, merge_policy
from fusion_core.decisions import Decisions, DecisionStoreWarning, best_times, distinct_copies, faster, pass_size

CPU = torch.device("cpu")
WAYS = (lambda: None, lambda: None)


class Clock:
    """What ``Decisions.times`` reports (``times``: one list per call, the last repeated) and the topics it timed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = [1.0, 0.5]  # the second way wins
        self.timed: list[str] = []
        monkeypatch.setattr(Decisions, "times", lambda table, ways, device: self.report(table))

    def report(self, table: Decisions[Any, Any]) -> list[float]:
        self.timed.append(table.topic)
        return list(self.times)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's store (its path), the default mode, nothing in memory before or after."""
    monkeypatch.setenv("FUSION_CORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSION_CORE_DECISIONS", raising=False)
    decisions.reset()
    yield tmp_path / "cache" / "decisions.json"
    decisions.reset()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


def _decide(table: Decisions[Any, int], kind: Any) -> int:
    return table.decide(kind, lambda: table.fastest(WAYS, CPU))


def _stored(path: Path) -> dict[str, Any]:
    """This machine's stored decisions by topic."""
    machines = json.loads(path.read_text())["machines"]
    return machines[decisions._machine()]["decisions"]  # type: ignore[no-any-return]


# -- measured once per kind ------------------------------------------------------------------------------
def test_a_kind_is_measured_once_and_its_decision_reused(store, clock):
    table: Decisions[Any, int] = Decisions("test.once")
    kind = ("cpu", torch.bfloat16, (64, 32), 1, False)
    assert [_decide(table, kind) for _ in range(3)] == [1, 1, 1] and clock.timed == ["test.once"]
    assert _decide(table, (*kind[:3], 2, False)) == 1 and len(clock.timed) == 2  # another kind: measured
    assert dict(table) == {kind: 1, (*kind[:3], 2, False): 1}
    # stored under the kind as JSON (the dtype by name), for this machine
    assert _stored(store) == {"test.once": {'["cpu","torch.bfloat16",[64,32],1,false]': 1,
                                            '["cpu","torch.bfloat16",[64,32],2,false]': 1}}


def test_the_store_is_read_once_per_process_not_once_per_kind(store, clock, monkeypatch):
    """Kinds are first decided on the first forward of each layer kind: reading the store there for each would put
    file I/O on the forward path, growing with the store."""
    table: Decisions[Any, int] = Decisions("test.reads")
    for rows in range(4):
        _decide(table, ("cpu", rows))  # measured, each written to the store
    reads: list[Path] = []
    real = decisions._read
    monkeypatch.setattr(decisions, "_read", lambda path: reads.append(path) or real(path))
    decisions.reset()  # as a fresh process: nothing in memory, the store on disk
    assert [_decide(table, ("cpu", rows)) for rows in range(4)] == [1, 1, 1, 1] and len(clock.timed) == 4
    assert reads == [store]


def test_the_tie_rule_keeps_the_first_way_unless_another_is_faster_beyond_the_margin(clock):
    table: Decisions[Any, int] = Decisions("test.tie")
    for times, taken in [([1.0, 0.99], 0), ([1.0, 0.97], 1), ([1.0, 1.5], 0), ([1.0, 0.5, 0.4], 2),
                         ([1.0, 0.4, 0.5], 1), ([1.0, 1.0, 0.99], 0)]:
        clock.times = times
        assert table.fastest([lambda: None] * len(times), CPU) == taken, times
    assert faster(0.97, 1.0) and not faster(0.99, 1.0) and not faster(1.0, 1.0)
    assert decisions.MARGIN == 1.02


def test_the_timer_runs_interleaved_rounds_until_the_noise_is_beaten():
    calls = [0, 0]

    def way(index: int, seconds: float) -> Callable[[], None]:
        def run() -> None:
            calls[index] += 1
            time.sleep(seconds)
        return run

    slow, fast = best_times([way(0, 0.010), way(1, 0.004)], CPU)
    assert slow > fast > 0.0035 and calls == [6, 6]  # one untimed round, five timed: 70 ms spent
    calls[:] = [0, 0]
    best_times([way(0, 0), way(1, 0)], CPU)
    assert calls == [51, 51]  # quick ways: rounds go on, to at most 50 timed
    calls[:] = [0, 0]
    best_times([way(0, 0.13), way(1, 0.13)], CPU)
    assert calls == [3, 3]  # slow ways: two timed rounds, as half a second holds no more


def test_a_pass_reads_distinct_weights_from_memory(monkeypatch):
    monkeypatch.setenv("FUSION_CORE_PASS_BYTES", str(64 * 2**20))  # the suite's own passes are 64 KiB (conftest.py)
    assert pass_size(4 * 2**20) == 16 and pass_size(16 * 2**20) == 4 and pass_size(2**30) == 1
    assert pass_size(1, available=3) == 3
    weight = torch.randn(1024, 1024).t()  # 4 MiB, transposed strides
    copies = distinct_copies(weight)
    assert len(copies) == 16 and copies[0] is weight
    assert len({c.data_ptr() for c in copies}) == 16 and all(c.stride() == weight.stride() for c in copies)
    assert all(torch.equal(c, weight) for c in copies)


def test_a_pass_reads_more_than_the_last_level_cache_holds(monkeypatch):
    """By default a CPU pass is the last-level cache plus 64 MiB (a pass the cache holds times the cache);
    ``FUSION_CORE_PASS_BYTES`` sets another size (the suite's 64 KiB); an accelerator's pass is 64 MiB."""
    monkeypatch.delenv("FUSION_CORE_PASS_BYTES")
    monkeypatch.setattr(decisions, "last_level_cache", lambda: 480 * 2**20)
    assert decisions.pass_bytes() == 544 * 2**20 and pass_size(2**20) == 544
    assert decisions.pass_bytes(torch.device("meta")) == 64 * 2**20
    monkeypatch.setenv("FUSION_CORE_PASS_BYTES", str(2**20))
    assert pass_size(2**18) == 4
    monkeypatch.setenv("FUSION_CORE_PASS_BYTES", "lots")
    with pytest.raises(ValueError, match="FUSION_CORE_PASS_BYTES='lots'"):
        pass_size(2**18)


def test_the_last_level_cache_is_the_largest_size_sysfs_reports(tmp_path):
    for index, size in enumerate(["48K", "2048K", "491520K\n", "junk"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size)
    assert decisions.last_level_cache(tmp_path) == 480 * 2**20
    assert decisions.last_level_cache(tmp_path / "missing") == 0


def test_the_merge_decision_times_a_pass_over_distinct_weights(monkeypatch):
    """The merged GEMM is timed on copies of the weight, each read once per pass, not one weight again and again."""
    monkeypatch.setenv("FUSION_CORE_PASS_BYTES", str(64 * 2**20))  # the suite's own passes are 64 KiB (conftest.py)
    read: list[int] = []
    linear = torch.nn.functional.linear

    def recording(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
        read.append(weight.data_ptr())
        return linear(input, weight, bias)

    def run_once(table: Decisions[Any, Any], ways: Any, device: Any) -> list[float]:
        monkeypatch.setattr(merge_policy.F, "linear", recording)
        ways[0]()  # the merged GEMM
        monkeypatch.setattr(merge_policy.F, "linear", linear)
        return [1.0, 2.0]

    monkeypatch.setattr(Decisions, "times", run_once)
    weight = torch.randn(2048, 512)  # 4 MiB
    assert merge_policy._merged_is_faster(torch.randn(1, 512), weight, None, ((0, 1024), (1024, 2048)))
    assert len(read) == 16 and len(set(read)) == 16 and weight.data_ptr() in read


# -- the store ---------------------------------------------------------------------------------------------
_PROCESS = """
import json, sys
import torch
from fusion_core.decisions import Decisions
timed = []
Decisions.times = lambda table, ways, device: timed.append(table.topic) or [float(t) for t in sys.argv[1:]]
table = Decisions("test.process")
taken = [table.decide(("cpu", torch.float32, rows), lambda: table.fastest([print] * 2, torch.device("cpu")))
         for rows in (1, 2, 1)]
print(json.dumps({"timed": len(timed), "taken": taken}))
"""


def _process(store: Path, *times: float, mode: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "FUSION_CORE_CACHE_DIR": str(store.parent)}
    env.pop("FUSION_CORE_DECISIONS", None)
    if mode is not None:
        env["FUSION_CORE_DECISIONS"] = mode
    proc = subprocess.run([sys.executable, "-c", _PROCESS, *map(str, times)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_a_fresh_process_reuses_the_stored_decisions_and_times_nothing(store):
    assert _process(store, 1.0, 0.5) == {"timed": 2, "taken": [1, 1, 1]}
    # a clock that would now choose the first way: the stored decisions are taken, nothing is timed
    assert _process(store, 0.5, 1.0) == {"timed": 0, "taken": [1, 1, 1]}
    assert _process(store, 0.5, 1.0, mode="measure") == {"timed": 2, "taken": [0, 0, 0]}  # re-measured, stored
    assert _process(store, 1.0, 0.5) == {"timed": 0, "taken": [0, 0, 0]}


@pytest.mark.slow
def test_a_fused_load_with_stored_decisions_times_nothing_and_decides_alike(store, tmp_path):
    """Two fresh processes load and decode a tiny model with every measured decision (merge, kernel, packing): the
    first measures, the second times nothing and takes the same decisions; `fusion tune` forgets them all."""
    from fusion_core.testing.tiny_models import TEXT_MODELS, save_tiny_model

    save_tiny_model(TEXT_MODELS["llama"], tmp_path / "llama")
    script = f"""
import json
import torch
from transformers import AutoModelForCausalLM
import fusion_core
from fusion_core.decisions import Decisions
from fusion_core.merge_policy import merge_decisions
from fusion_linear_kernels import decisions, pack_decisions
timed, clock = [], Decisions.times
Decisions.times = lambda table, ways, device: timed.append(table.topic) or clock(table, ways, device)
model = fusion_core.from_pretrained(AutoModelForCausalLM, {str(tmp_path / "llama")!r},
                                    fusion_config={{"qkv": True, "gate_up": True, "linear_kernels": True}}).eval()
with torch.no_grad():
    model.generate(torch.tensor([[5, 17, 42, 9]]), max_new_tokens=3, do_sample=False)
taken = {{name: sorted(map(str, table.items())) for name, table in
         (("merge", merge_decisions()), ("choice", decisions()), ("packing", pack_decisions()))}}
print(json.dumps({{"timed": sorted(set(timed)), "count": len(timed), "taken": taken}}))
"""
    env = {**os.environ, "FUSION_CORE_CACHE_DIR": str(store.parent), "FUSION_CORE_MERGE": "measure"}
    env.pop("FUSION_CORE_DECISIONS", None)

    def load() -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]

    first, second = load(), load()
    assert first["count"] > 0 and "linear_kernels.packing" in first["timed"], first  # which others: as measured
    assert second["count"] == 0 and second["taken"] == first["taken"]
    tune = subprocess.run([sys.executable, "-m", "fusion_core", "tune", "--json"], env=env, capture_output=True,
                          text=True, timeout=300)  # every decision the first load took was stored, and is forgotten
    assert tune.returncode == 0 and json.loads(tune.stdout)["forgotten"] == sum(map(len, first["taken"].values()))


def test_another_fingerprint_measures_anew_and_keeps_both(store, clock, monkeypatch):
    table: Decisions[Any, int] = Decisions("test.fingerprint")
    kind = ("cpu", torch.float32, (8, 8))
    assert _decide(table, kind) == 1 and len(clock.timed) == 1
    decisions.reset()
    assert _decide(table, kind) == 1 and len(clock.timed) == 1  # read from the store
    here = decisions.fingerprint()
    for change in ({"cpu_flags": "0123456789abcdef"}, {"torch": "2.99.0"}, {"plugins": "an upgraded family"}):
        monkeypatch.setattr(decisions, "fingerprint", lambda change=change: {**here, **change})
        decisions.reset()
        clock.times = [0.5, 1.0]
        assert _decide(table, kind) == 0 and len(clock.timed) == 2  # measured again for this "machine"
        clock.timed.clear()
        clock.timed.append("reset")
    monkeypatch.setattr(decisions, "fingerprint", lambda: here)
    decisions.reset()
    assert _decide(table, kind) == 1 and clock.timed == ["reset"]  # this machine's stored decision again
    machines = json.loads(store.read_text())["machines"]
    assert len(machines) == 4 and sorted(m["fingerprint"]["torch"] for m in machines.values()).count("2.99.0") == 1


def test_measure_mode_measures_again_and_stores_the_new_decision(store, clock, monkeypatch):
    table: Decisions[Any, int] = Decisions("test.measure")
    assert _decide(table, "kind") == 1
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "measure")
    decisions.reset()
    clock.times = [0.5, 1.0]
    assert _decide(table, "kind") == 0 and len(clock.timed) == 2
    assert _stored(store)["test.measure"] == {'"kind"': 0}
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "sometimes")
    decisions.reset()
    with pytest.raises(ValueError, match="FUSION_CORE_DECISIONS: unknown mode 'sometimes'; expected one of stored, "
                                         "measure, off"):
        _decide(table, "kind")


def test_fusion_tune_forgets_this_machines_stored_decisions(store, clock, monkeypatch, capsys):
    table: Decisions[Any, int] = Decisions("test.tune")
    here = decisions.fingerprint()
    _decide(table, "a"), _decide(table, "b")
    monkeypatch.setattr(decisions, "fingerprint", lambda: {**here, "cpu": "another"})
    _decide(table, "a")  # in memory already: nothing stored for the other machine
    decisions.reset()
    _decide(table, "a")
    monkeypatch.setattr(decisions, "fingerprint", lambda: here)
    assert len(clock.timed) == 3
    assert cli.main(["tune"]) == 0
    assert f"Forgot 2 of this machine's stored decisions in {store}" in capsys.readouterr().out
    assert table == {} and _stored(store) == {}
    assert _decide(table, "a") == 1 and len(clock.timed) == 4  # measured again
    assert cli.main(["tune", "--json"]) == 0 and json.loads(capsys.readouterr().out)["forgotten"] == 1
    assert cli.main(["tune", "--every-machine", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forgotten"] == 1  # the other machine's
    assert all(not m["decisions"] for m in json.loads(store.read_text())["machines"].values())


def test_forgetting_a_topic_measures_it_again_and_keeps_the_others(store, clock):
    first: Decisions[Any, int] = Decisions("test.first")
    second: Decisions[Any, int] = Decisions("test.second")
    _decide(first, "k"), _decide(second, "k")
    first.forget()
    assert first == {} and second == {"k": 1} and set(_stored(store)) == {"test.second"}
    _decide(first, "k")
    assert clock.timed == ["test.first", "test.second", "test.first"]


def test_decisions_of_another_code_are_measured_again_and_both_kept(store, clock):
    """A kernel built from other code (a checkout of another commit shares the distributions' versions) may rank the
    ways otherwise: a table's ``code`` keeps its stored decisions apart, under the same topic."""
    old: Decisions[Any, int] = Decisions("test.code", code="a")
    assert _decide(old, "k") == 1
    decisions.reset()
    clock.times = [0.5, 1.0]  # the new code's first way wins
    new: Decisions[Any, int] = Decisions("test.code", code="b")
    assert _decide(new, "k") == 0 and clock.timed == ["test.code", "test.code"]  # measured again, same topic
    assert _stored(store) == {"test.code@a": {'"k"': 1}, "test.code@b": {'"k"': 0}}
    decisions.reset()
    assert _decide(Decisions("test.code", code="a"), "k") == 1 and len(clock.timed) == 2  # the old one's, stored
    new.forget()
    assert set(_stored(store)) == {"test.code@a"}


def test_clearing_a_table_starts_a_new_generation(store, clock):
    """What a hot path remembers of a decision outside the table (a layer's last kernel) lasts one generation."""
    table: Decisions[Any, int] = Decisions("test.generation")
    _decide(table, "k")
    assert table.generation == 0
    table.forget()
    assert table.generation == 1
    _decide(table, "k")
    decisions.reset()
    assert table.generation == 2 and table == {}


def test_off_uses_and_writes_no_store(store, clock, monkeypatch):
    table: Decisions[Any, int] = Decisions("test.off")
    _decide(table, "stored")
    before = store.read_text()
    monkeypatch.setenv("FUSION_CORE_DECISIONS", "off")
    decisions.reset()
    clock.times = [0.5, 1.0]
    assert _decide(table, "stored") == 0 and _decide(table, "new") == 0 and len(clock.timed) == 3
    table.forget()
    assert store.read_text() == before


def test_the_store_lies_in_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSION_CORE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert decisions.store_path() == tmp_path / "xdg" / "fusion_core" / "decisions.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert decisions.store_path() == tmp_path / "home" / ".cache" / "fusion_core" / "decisions.json"
    monkeypatch.setenv("FUSION_CORE_CACHE_DIR", str(tmp_path / "mine"))
    assert decisions.store_path() == tmp_path / "mine" / "decisions.json"


def test_the_test_session_stores_nothing_in_the_users_cache():
    """Not here, and not in a subprocess started as a user runs ``fusion`` (without any ``FUSION_CORE_*``)."""
    session = Path(os.environ["FUSION_CORE_CACHE_DIR"])
    assert session.name.startswith("fusion-core-test-cache-") and decisions.store_path().parent == session
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_CORE_")}
    code = "from fusion_core.decisions import store_path; print(store_path())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert Path(proc.stdout.strip()).is_relative_to(session), proc.stderr


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": 99, "machines": {}}',
                                     '{"format": 1, "machines": {"x": {"decisions": []}}}', "\udcff"])
def test_a_corrupt_store_is_warned_about_once_measured_again_and_replaced(store, clock, content):
    store.parent.mkdir(parents=True)
    store.write_bytes(content.encode("utf-8", "surrogateescape"))
    table: Decisions[Any, int] = Decisions("test.corrupt")
    with pytest.warns(DecisionStoreWarning, match="cannot be read|is not a format-1 store") as caught:
        assert _decide(table, "a") == 1
    assert len(caught) == 1 and len(clock.timed) == 1
    assert _stored(store) == {"test.corrupt": {'"a"': 1}}  # replaced by a valid store
    assert [p.name for p in store.parent.iterdir()] == ["decisions.json"]  # no temporary file left


def test_an_unreadable_unwritable_store_is_warned_about_once_and_decisions_kept_in_memory(store, clock):
    store.mkdir(parents=True)  # a directory where the file should be: neither read nor replaced
    table: Decisions[Any, int] = Decisions("test.unwritable")
    with pytest.warns(DecisionStoreWarning) as caught:
        assert _decide(table, "a") == 1 and _decide(table, "b") == 1
    assert len(caught) == 1 and "cannot be read" in str(caught[0].message)
    assert table == {"a": 1, "b": 1} and len(clock.timed) == 2
    assert [p.name for p in store.parent.iterdir()] == ["decisions.json"]  # no temporary file left


def test_a_failed_write_keeps_the_previous_store(store, clock, monkeypatch):
    table: Decisions[Any, int] = Decisions("test.atomic")
    _decide(table, "a")
    before = store.read_text()

    def refuse(source: str, target: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(decisions.os, "replace", refuse)
    with pytest.warns(DecisionStoreWarning, match="cannot be written .*disk full"):
        assert _decide(table, "b") == 1
    assert store.read_text() == before and [p.name for p in store.parent.iterdir()] == ["decisions.json"]


def test_processes_storing_at_once_each_keep_their_decisions(store):
    """Two writers at once (the ranks of one job deciding together): the second waits for the first's write, so
    neither decision is lost (without the lock, the second read the store before the first wrote it and the first's
    write replaced the second's)."""
    import threading

    first_read = threading.Event()

    def add(topic: str, hold: float) -> Callable[[dict[str, Any]], bool]:
        def edit(machines: dict[str, Any]) -> bool:
            decisions._mine(machines)[topic] = {"kind": 1}
            first_read.set()
            time.sleep(hold)
            return True

        return edit

    slow = threading.Thread(target=decisions._change, args=(add("test.first", 0.5),))
    slow.start()
    first_read.wait(10)
    decisions._change(add("test.second", 0.0))
    slow.join()
    assert {"test.first", "test.second"} <= set(_stored(store))


def test_a_stored_value_is_loaded_back_as_the_caller_keeps_it(store, clock):
    """Tuples come back as tuples; a ``load`` that does not know a stored value (None) has it measured again."""
    pairs: Decisions[Any, tuple[bool, str]] = Decisions("test.pairs")
    assert pairs.decide("k", lambda: (True, "why")) == (True, "why")
    names: Decisions[Any, str] = Decisions("test.names", load=lambda name: name if name in ("mv", "linear") else None)
    names.decide("known", lambda: "mv")
    names.decide("gone", lambda: "removed kernel")
    decisions.reset()
    assert pairs.decide("k", lambda: (False, "measured")) == (True, "why")
    assert names.decide("known", lambda: "linear") == "mv"
    assert names.decide("gone", lambda: "linear") == "linear"


# -- reset_state ------------------------------------------------------------------------------------------
def test_reset_state_forgets_the_decisions_in_memory_and_keeps_the_store(store, clock):
    from fusion_linear_kernels import choice

    table: Decisions[Any, int] = Decisions("test.reset")
    _decide(table, "k")
    merge_policy.DECISIONS["probe"] = True
    choice._DECISIONS["probe"] = choice.kernels.LINEAR
    fusion_core.reset_state()
    assert table == {} and merge_policy.merge_decisions() == {} and choice.decisions() == {}
    assert _decide(table, "k") == 1 and clock.timed == ["test.reset"]  # from the store: nothing timed
