"""What one separate job accepts from another: the settings digest covers what decides a prompt, its
reference and its reward (files by content), a record's numbers are checked against their real ranges,
a run nonce keeps records of an earlier run out, degenerate keys are refused, and a waiting job stops
when the exchange folder is gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.exchange.remote import ExchangeRecordError, KeyFileError, LocalStore, load_key
from hacrl_megatron.exchange.remote.shared_dir import SharedDirStore
from hacrl_megatron.exchange.remote.store import ExchangeBackendError, RunJoinError
from hacrl_megatron.trainer.peers import ExchangeMismatch, PeerExchange
from hacrl_megatron.trainer.run_identity import mismatch, shared_config_fields
from tests.unit.test_peer_exchange_record import KEY, edited, make_record, parse

CUSTOM = Path(__file__).resolve().parents[1] / "fixtures" / "datasets" / "custom" / "train.jsonl"
CHECKER = "def score(response, reference):\n    return float(response.strip() == reference.strip())\n"


def _fields(*overrides: str) -> dict[str, str]:
    return shared_config_fields(load_config("cpu_demo", list(overrides)))


def test_the_checker_enters_by_content_not_by_path(tmp_path):
    for folder in ("a", "b with space"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "check.py").write_text(CHECKER)
    one = _fields(f"data.checker={tmp_path / 'a' / 'check.py'}:score")
    same = _fields(f"data.checker={tmp_path / 'b with space' / 'check.py'}:score")
    assert one == same  # another copy of the same file elsewhere: one run
    (tmp_path / "b with space" / "check.py").write_text("def score(response, reference):\n    return 1.0\n")
    other = _fields(f"data.checker={tmp_path / 'b with space' / 'check.py'}:score")
    assert mismatch(one, other) == "data.checker"
    assert mismatch(one, _fields()) == "data.checker"  # no checker at all


def test_the_data_file_enters_by_content_and_the_reward_settings_by_value(tmp_path):
    copy = tmp_path / "copy.jsonl"
    shutil.copy(CUSTOM, copy)
    base = ["data.task=custom", "data.eval_size=0"]
    one = _fields(*base, f"data.path={CUSTOM}")
    assert _fields(*base, f"data.path={copy}") == one
    rows = CUSTOM.read_text().splitlines()
    first = json.loads(rows[0])
    first["answer"] = str(first.get("answer", "")) + "0"  # the same id, another reference answer
    copy.write_text("\n".join([json.dumps(first), *rows[1:]]) + "\n")
    assert mismatch(one, _fields(*base, f"data.path={copy}")) == "data.path (file content)"
    assert mismatch(_fields(), _fields("train.verifier_mode=math_verify")) == "train.verifier_mode"
    assert mismatch(_fields(), _fields("data.reward_range=[0, 2]")) == "data.reward_range"
    assert mismatch(_fields(), _fields("output_dir=elsewhere", "train.steps=3")) == ""  # where and how long: not shared


@pytest.mark.parametrize("changes, field", [
    ({"rewards": [[-5.0, 0.0], [0.0, 1.0]]}, "rewards[0][0]"),
    ({"rewards": [[1e300, 0.0], [0.0, 1.0]]}, "rewards[0][0]"),
    ({"logp_sums": [[3.0, -17.5], [-0.125, -1e-9]]}, "logp_sums[0][0]"),
    ({"logp_sums": [[-1e300, -17.5], [-0.125, -1e-9]]}, "logp_sums[0][0]"),
    ({"lengths": [[9, 12], [0, 2]], "logp_sums": [[-3.25, -17.5], [-0.5, -1e-9]]}, "logp_sums[1][0]"),
    ({"lengths": [[10, 12], [1, 2]]}, "lengths[0][0]"),
    ({"responses": [["x" * 3000, "y"], ["", "7"]]}, "responses[0][0]"),
    ({"weights_version": 5}, "weights_version"),
    ({"positive_rate": 1.0}, "positive_rate"),
])
def test_numbers_out_of_their_real_range_are_refused_naming_the_field(changes, field):
    with pytest.raises(ExchangeRecordError) as info:
        parse(edited(make_record(), **changes))
    assert f"exchange record of agent 'agent1' refused (test): field '{field}'" in str(info.value)


def test_a_fresh_job_draws_a_nonce_its_peers_join_and_an_earlier_runs_records_are_refused(tmp_path):
    llama, qwen = SharedDirStore(tmp_path / "ex", "run"), SharedDirStore(tmp_path / "ex", "run")
    first = llama.join_run("llama", fresh=True)
    assert qwen.join_run("qwen3", fresh=True) == first and len(first) == 32
    old = make_record(step=0, agent="qwen3", run_id="run", weights_version=0, run_nonce=first)
    qwen.publish(old)
    assert llama.read(0, "qwen3") == old
    # a new fresh run of the same run id (the same key, the records left in place): a new nonce
    again = SharedDirStore(tmp_path / "ex", "run")
    second = again.join_run("llama", fresh=True)
    assert second != first
    with pytest.raises(ExchangeRecordError, match=rf"field 'run_nonce': '{first}', this run's is '{second}': a record "
                                                  "of an earlier run"):
        again.read(0, "qwen3")
    assert SharedDirStore(tmp_path / "ex", "run").join_run("qwen3", fresh=True) == second  # the peer joins the new run
    assert SharedDirStore(tmp_path / "ex", "run").join_run("llama", fresh=False) == second  # a resume continues it
    with pytest.raises(RunJoinError, match="resumes agent 'mistral', but the run's jobs since started a fresh run"):
        SharedDirStore(tmp_path / "ex", "run").join_run("mistral", fresh=False)


def test_two_fresh_jobs_racing_share_one_nonce():
    stores = [LocalStore("run")]
    stores.append(LocalStore("run", share_with=stores[0]))
    assert stores[0].join_run("a", fresh=True) == stores[1].join_run("b", fresh=True)


def test_a_forged_run_document_is_refused_when_signed(tmp_path):
    honest = SharedDirStore(tmp_path / "ex", "run", key=KEY)
    honest.join_run("llama", fresh=True)
    (tmp_path / "ex" / "run" / "run.00000002.json").write_text(json.dumps({"nonce": "0" * 32, "agents": ["llama"]}))
    with pytest.raises(RunJoinError, match="run document 2: field 'hmac_sha256': missing"):
        SharedDirStore(tmp_path / "ex", "run", key=KEY).join_run("qwen3", fresh=True)
    (tmp_path / "ex" / "run" / "run.00000002.json").write_text("{not json")
    with pytest.raises(RunJoinError, match="run document 2: not valid JSON"):
        SharedDirStore(tmp_path / "ex", "run").join_run("qwen3", fresh=True)


@pytest.mark.parametrize("content", [b"k" * 32, b"ab" * 16, b"abcdabcdabcdabcdabcd"])
def test_a_degenerate_key_is_refused(tmp_path, content):
    path = tmp_path / "exchange.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match=rf"exchange.key_file {path}: {len(content)} bytes of only \d distinct"):
        load_key(path)
    path.write_bytes(KEY)
    assert load_key(path) == KEY


def test_a_waiting_reader_stops_when_the_exchange_folder_is_gone(tmp_path):
    store = SharedDirStore(tmp_path / "ex", "run")
    assert store.wait_for(0, ["qwen3"], wait_s=0).missing == ("qwen3",)  # no record yet: missing, not an error
    shutil.rmtree(tmp_path / "ex")
    with pytest.raises(ExchangeBackendError, match=rf"exchange folder {tmp_path / 'ex' / 'run'}: gone"):
        store.wait_for(0, ["qwen3"], wait_s=60)


def test_a_peers_weights_version_never_goes_backwards_nor_lags_past_the_mode():
    exp = load_config("cpu_demo", ["exchange.backend=shared_dir", "exchange.dir=unused"])
    agents = [SimpleNamespace(index=0, name="llama"), SimpleNamespace(index=1, name="qwen3")]
    peers = PeerExchange(exp, agents, agents[0], LocalStore("cpu_demo"))
    prompts = [SimpleNamespace(id="p0"), SimpleNamespace(id="p1")]
    data = SimpleNamespace(prompts=prompts)

    def record(step: int, version: int):
        return make_record(step=step, agent="qwen3", run_id="cpu_demo", weights_version=version,
                           config_digest=peers.digest, config_fields=peers.config_fields)

    peers._check(3, record(3, 3), data, 2)  # sync: the step's own weights
    with pytest.raises(ExchangeMismatch, match=r"field 'weights_version': 2; a record of step 4 must come from "
                                               r"weights 4..4 \(train.rollout_mode=sync\)"):
        peers._check(4, record(4, 2), data, 2)
    peers.lag = 3  # an overlapping mode: older weights are allowed, but never older than the last record's
    with pytest.raises(ExchangeMismatch, match="no older than the 3 of its last record"):
        peers._check(5, record(5, 2), data, 2)
