"""agents/logprob_path.py: one rule picks the last stage's log-prob path, for the trainer and the planner.

The trainer's head (``agents.lm_head.build_lm_head``) and the planner's memory
(``plan.memory.trainer_memory``) both call ``logprob_path``; the planner's materialised-logits term
is exactly 0 on the fused path and ``6 B × tokens × V_pad/tp`` on megatron's, with or without
sequence parallelism. The numerical equality of the two paths under TP2 · SP is
tests/distributed/test_sp_logprobs.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hacrl_megatron.agents import logprob_path as paths
from hacrl_megatron.agents.logprob_path import LOGPROB_IMPLS, LogProbPath, logprob_path
from hacrl_megatron.cli import main as hacrl
from hacrl_megatron.plan.known_models import KNOWN_CONFIGS
from hacrl_megatron.plan.memory import GIB, Layout, Workload, head_bytes, logits_bytes, trainer_memory
from hacrl_megatron.plan.params import arch_from_config

LLAMA70B = arch_from_config(KNOWN_CONFIGS["Llama-3.1-70B-Instruct"])
# multinode_llama70b_qwen72b's llama70b: TP4 · PP8, 1024 + 4096 tokens, one sequence per micro-batch
WORK = dict(seq_len=5120, micro_batch=1, microbatches=128)


def _layout(sp: bool) -> Layout:
    return Layout(4, 8, 1, sequence_parallel=sp, recompute="selective")


def _materialised_logits(spec, layout: Layout, work: Workload) -> float:
    """bf16 logits + fp32 softmax of every token of a micro-batch over this rank's vocabulary shard."""
    return 6 * work.seq_len * work.micro_batch * spec.padded_vocab_size(layout.tp) / layout.tp


@pytest.mark.parametrize("impl", ["auto", "reference", "triton"])
@pytest.mark.parametrize("sp", [False, True])
def test_every_kernel_impl_stays_fused_under_sequence_parallelism(impl, sp):
    path = logprob_path(impl, sp)
    assert path == LogProbPath("fused", impl, gather_rows=sp)
    assert not path.materialises_logits


@pytest.mark.parametrize("sp", [False, True])
def test_only_megatron_materialises_logits(sp):
    path = logprob_path("megatron", sp)
    assert path == LogProbPath("megatron", None, gather_rows=False) and path.materialises_logits
    assert [i for i in LOGPROB_IMPLS if logprob_path(i, sp).materialises_logits] == ["megatron"]


def test_an_unknown_impl_is_refused_by_trainer_and_planner():
    with pytest.raises(ValueError, match=r"logprob_impl='fast': must be one of \['auto', 'reference'"):
        logprob_path("fast", False)
    with pytest.raises(ValueError, match="logprob_impl='fast'"):
        Workload(seq_len=16, logprob_impl="fast")


@pytest.mark.parametrize("sp", [False, True])
def test_planner_logits_term_is_zero_fused_and_the_logits_on_megatron(sp):
    layout = _layout(sp)
    fused = trainer_memory(LLAMA70B, layout, Workload(**WORK))
    plain = trainer_memory(LLAMA70B, layout, Workload(**WORK, logprob_impl="megatron"))
    logits = _materialised_logits(LLAMA70B, layout, Workload(**WORK))
    assert fused[-1].logits == 0.0 and fused[-1].logprob_path == "fused"
    assert plain[-1].logits == logits and plain[-1].logprob_path == "megatron"
    assert all(st.logits == 0.0 for st in plain[:-1])  # only the last stage holds a head
    # the two plans differ by the head alone, and the saving reported is that difference
    assert plain[-1].activations - fused[-1].activations == pytest.approx(fused[-1].logits_avoided)
    assert plain[-1].logits_avoided == fused[-1].logits_avoided
    assert [st.activations for st in plain[:-1]] == [st.activations for st in fused[:-1]]


def test_planner_counts_the_gathered_rows_under_sequence_parallelism():
    """Fused: every TP rank keeps all N scored rows (gathered under SP); megatron's output layer keeps
    its sequence shard (N/tp rows) and re-gathers in backward."""
    work = Workload(**WORK)
    tokens, h, tp = WORK["seq_len"], LLAMA70B.hidden_size, 4
    for sp in (False, True):
        layout = _layout(sp)
        fused = head_bytes(LLAMA70B, layout, work, logprob_path("auto", sp))
        plain = head_bytes(LLAMA70B, layout, work, logprob_path("megatron", sp))
        assert logits_bytes(LLAMA70B, layout, work, logprob_path("auto", sp)) == 0.0
        assert plain - logits_bytes(LLAMA70B, layout, work, logprob_path("megatron", sp)) == \
            2 * tokens * h / (tp if sp else 1)
        assert fused == 2 * tokens * h + 8 * tokens + 2**28


def test_changing_sp_moves_the_planner_logits_term_only_through_the_rule(monkeypatch):
    """The planner and the trainer ask one function: with the earlier rule (sequence parallelism
    falls back to megatron's logits) put into it, flipping SP on the same layout moves the planner's
    logits term from exactly 0 to the materialised logits, and the trainer's head goes megatron too."""
    from hacrl_megatron.agents.lm_head import build_lm_head

    work = Workload(**WORK)
    real = paths.logprob_path
    by_sp = {sp: trainer_memory(LLAMA70B, _layout(sp), work)[-1].logits for sp in (False, True)}
    assert by_sp == {False: 0.0, True: 0.0}  # today: fused either way

    def earlier_rule(impl: str, sequence_parallel: bool) -> LogProbPath:
        return real("megatron" if sequence_parallel else impl, sequence_parallel)

    monkeypatch.setattr(paths, "logprob_path", earlier_rule)
    by_sp = {sp: trainer_memory(LLAMA70B, _layout(sp), work)[-1].logits for sp in (False, True)}
    assert by_sp == {False: 0.0, True: _materialised_logits(LLAMA70B, _layout(True), work)}
    head = build_lm_head(None, "auto", vocab_size=LLAMA70B.vocab_size, tp=4, sequence_parallel=True)
    assert head.path.name == "megatron" and head.impl == "megatron"


def test_trainer_head_follows_the_rule():
    """build_lm_head: the fused path swaps the last stage's output layer for a pass-through and reads
    the LM-head weight (tied: the embedding's); megatron's path leaves the model alone. Sequence
    parallelism asked at tp = 1 is not in effect (no row gather)."""
    pytest.importorskip("megatron.core")
    from hacrl_megatron.agents.lm_head import build_lm_head

    layer = SimpleNamespace(weight="W", forward=None)
    model = SimpleNamespace(post_process=True, share_embeddings_and_output_weights=True, output_layer=layer,
                            shared_embedding_or_output_weight=lambda: "E")
    head = build_lm_head(model, "reference", vocab_size=97, tp=1, sequence_parallel=True)
    assert head.path == LogProbPath("fused", "reference", gather_rows=False) and head.tp_group is None
    assert head.weight() == "E" and layer.forward("h") == ("h", None)
    untouched = SimpleNamespace(weight="W", forward=None)
    head = build_lm_head(SimpleNamespace(output_layer=untouched), "megatron", vocab_size=97, tp=1,
                         sequence_parallel=False)
    assert head.impl == "megatron" and head.weight is None and untouched.forward is None


def test_plan_cli_takes_the_logprob_impl(tmp_path, capsys):
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_CONFIGS["Llama-3.1-70B"]))
    base = ["plan", "--model", str(folder), "--tp", "4", "--pp", "8", "--dp", "1", "--sequence-parallel",
            "--seq-len", "5120", "--gpu-memory-gib", "74.5", "--json"]
    out = {}
    for impl in ("auto", "megatron"):
        assert hacrl([*base, "--logprob-impl", impl]) == 0
        out[impl] = json.loads(capsys.readouterr().out)["agents"][0]["logits_gib"]
    assert out["auto"]["path"] == "fused" and out["auto"]["logits"] == 0.0
    assert out["megatron"]["path"] == "megatron"
    assert out["megatron"]["logits"] == pytest.approx(6 * 5120 * 128256 / 4 / GIB, abs=0.01)
    for key in ("last_stage_activations_with_fused_kernel", "last_stage_activations_with_materialised_logits",
                "saved_by_fused_kernel"):
        assert out["auto"][key] == out["megatron"][key], key  # either path reports the same alternatives
    assert out["megatron"]["last_stage_activations"] == out["megatron"]["last_stage_activations_with_materialised_logits"]
    assert hacrl([*base[:-1], "--logprob-impl", "megatron"]) == 0
    assert "materialised logits (logprob_impl megatron) hold 0.92 GiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        hacrl([*base, "--logprob-impl", "fast"])
