"""The per-(step, agent) exchange record: JSON round trip, the checks on read, HMAC signing, key files."""

from __future__ import annotations

import json
import math

import pytest

from hacrl_megatron.exchange.records import Trajectory
from hacrl_megatron.exchange.remote import (
    ExchangeRecordError,
    KeyFileError,
    Limits,
    PeerRecord,
    load_key,
    parse_record,
)
from hacrl_megatron.exchange.remote.signing import SIGNATURE_FIELD, canonical

KEY = b"0123456789abcdef0123456789abcdef"


def make_record(step: int = 4, agent: str = "agent1", run_id: str = "run-a", **over) -> PeerRecord:
    fields = dict(run_id=run_id, step=step, agent=agent, weights_version=min(3, step), prompt_ids=["p0", "p1"],
                  responses=[["The answer is \\boxed{4}.", "ünïcode ✓ 5"], ["", "7"]],
                  finish_reasons=[["eos", "length"], ["eos", "eos"]], rewards=[[1.0, 0.0], [0.0, 1.0]],
                  logp_sums=[[-3.25, -17.5], [-0.125, -1e-9]], lengths=[[9, 12], [1, 2]],
                  response_tokens=[[8, 12], [0, 1]], positive_rate=0.5, config_digest="sha256:0f")
    fields.update(over)
    return PeerRecord(**fields)


def parse(data: bytes, **over):
    kwargs = dict(run_id="run-a", step=4, agent="agent1", origin="test", key=None)
    kwargs.update(over)
    return parse_record(data, **kwargs)


def edited(record: PeerRecord, key: bytes | None = None, **changes) -> bytes:
    """The record's JSON with fields replaced, written as a hostile or broken writer would."""
    obj = json.loads(record.to_json(key))
    obj.update(changes)
    return json.dumps(obj).encode()


def test_round_trip_is_exact_and_frozen():
    record = make_record()
    back = parse(record.to_json())
    assert back == record
    assert back.logp_sums[1][1] == -1e-9 and back.responses[0][1] == "ünïcode ✓ 5"  # exact floats, unicode
    assert isinstance(back.responses, tuple) and isinstance(back.responses[0], tuple)
    assert back.num_responses == 4
    with pytest.raises(AttributeError):
        back.step = 5
    assert record.to_json().isascii()
    text = record.to_json().decode()
    assert '\n "rewards": [\n  [1.0, 0.0],\n  [0.0, 1.0]\n ]' in text  # one prompt's group per line


def test_signed_round_trip_and_unsigned_reader_ignores_signature():
    record = make_record()
    signed = record.to_json(KEY)
    assert json.loads(signed)[SIGNATURE_FIELD]
    assert parse(signed, key=KEY) == record
    assert parse(signed) == record


@pytest.mark.parametrize("data, field", [
    (b'{"agent": "agent1", "step": 4', "record"),  # truncated
    (b"\xff\xfe", "record"),
    (b"[1, 2]", "record"),
    (b"[" * 100000, "record"),  # nesting deeper than the parser recurses
])
def test_unparsable_refused_naming_author(data, field):
    with pytest.raises(ExchangeRecordError) as err:
        parse(data)
    msg = str(err.value)
    assert "agent 'agent1'" in msg and f"field {field!r}" in msg and "\n" not in msg


@pytest.mark.parametrize("changes, field", [
    ({"run_id": "run-b"}, "run_id"),
    ({"step": 5}, "step"),
    ({"agent": "agent2"}, "agent"),
    ({"format": "hacrl-exchange/0"}, "format"),
    ({"extra": 1}, "extra"),
    ({"step": "4"}, "step"),
    ({"step": True}, "step"),
    ({"weights_version": -1}, "weights_version"),
    ({"positive_rate": 1.5}, "positive_rate"),
    ({"prompt_ids": []}, "prompt_ids"),
    ({"prompt_ids": ["p0", 3]}, "prompt_ids[1]"),
    ({"responses": [["a", "b"]]}, "responses"),
    ({"responses": [["a", "b"], []]}, "responses[1]"),
    ({"responses": [["a", 1], ["b", "c"]]}, "responses[0][1]"),
    ({"rewards": [[1.0], [0.0, 1.0]]}, "rewards[0]"),
    ({"rewards": [[1.0, "1"], [0.0, 1.0]]}, "rewards[0][1]"),
    ({"logp_sums": [[None, 1.0], [0.0, 1.0]]}, "logp_sums[0][0]"),
    ({"lengths": [[1, 2.5], [1, 1]]}, "lengths[0][1]"),
    ({"lengths": [[1, -1], [1, 1]]}, "lengths[0][1]"),
    ({"finish_reasons": [["eos", "stop"], ["eos", "eos"]]}, "finish_reasons[0][1]"),
])
def test_damaged_fields_refused_naming_author_and_field(changes, field):
    data = edited(make_record(), **changes)
    with pytest.raises(ExchangeRecordError) as err:
        parse(data)
    msg = str(err.value)
    assert msg.startswith("exchange record of agent 'agent1' refused (test): ")
    assert f"field {field!r}" in msg and "\n" not in msg


def test_missing_field_refused():
    obj = json.loads(make_record().to_json())
    del obj["lengths"]
    with pytest.raises(ExchangeRecordError, match="field 'lengths': missing"):
        parse(json.dumps(obj).encode())


def test_nan_reward_refused_even_as_a_literal():
    text = make_record().to_json().decode().replace("[1.0, 0.0]", "[NaN, 0.0]", 1)
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent1'.*field 'record'.*NaN"):
        parse(text.encode())
    overflow = make_record().to_json().decode().replace("[1.0, 0.0]", "[1.0, 1e999]", 1)  # parses as inf
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent1'.*field 'rewards\[0\]\[1\]'.*finite"):
        parse(overflow.encode())
    with pytest.raises(ValueError, match=r"rewards\[0\]\[0\]"):  # nor can one be built
        make_record(rewards=[[math.nan, 0.0], [0.0, 1.0]])


def test_oversized_refused_before_parsing():
    record = make_record(responses=[["x" * 5000, "y"], ["z", "w"]], response_tokens=[[5000, 12], [1, 1]])
    data = record.to_json()
    small = Limits(max_bytes=len(data) - 1)
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent1'.*field 'record'.*larger than the limit"):
        parse(data, limits=small)
    with pytest.raises(ExchangeRecordError, match=r"responses\[0\]\[0\]"):
        parse(data, limits=Limits(max_text_chars=4096))
    with pytest.raises(ExchangeRecordError, match="field 'prompt_ids'"):
        parse(data, limits=Limits(max_prompts=1))
    with pytest.raises(ExchangeRecordError, match=r"field 'responses\[0\]'"):
        parse(data, limits=Limits(max_group=1))
    assert parse(data) == record


def test_forged_records_refused_naming_author():
    record = make_record()
    forged = edited(record, KEY, rewards=[[1.0, 1.0], [1.0, 1.0]])  # signature of the original kept
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent1'.*field 'hmac_sha256'.*does not match"):
        parse(forged, key=KEY)
    other_key = record.to_json(b"another key, 16 bytes or more")
    with pytest.raises(ExchangeRecordError, match="does not match"):
        parse(other_key, key=KEY)
    with pytest.raises(ExchangeRecordError, match=r"agent 'agent1'.*field 'hmac_sha256'.*missing"):
        parse(record.to_json(), key=KEY)
    with pytest.raises(ExchangeRecordError, match="hex string"):
        parse(edited(record, KEY, **{SIGNATURE_FIELD: 7}), key=KEY)


def test_signature_covers_canonical_json_not_layout():
    record = make_record()
    compact = json.dumps(json.loads(record.to_json(KEY)), separators=(",", ":")).encode()  # re-laid out
    assert parse(compact, key=KEY) == record
    assert canonical(json.loads(record.to_json(KEY))) == canonical(record.to_dict())


def test_key_file_rules(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    assert load_key(path) == KEY
    path.chmod(0o640)
    assert load_key(path) == KEY  # group-readable: a project group may share the key
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=f"exchange.key_file {path}: readable or writable by every user"):
        load_key(path)
    path.chmod(0o602)
    with pytest.raises(KeyFileError, match=str(path)):
        load_key(path)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(KeyFileError, match=f"{short}: 3 bytes, at least 16"):
        load_key(short)
    with pytest.raises(KeyFileError, match="cannot read it"):
        load_key(tmp_path / "absent")
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_key(tmp_path)


def test_from_trajectories_groups_by_prompt():
    def traj(pid, text, reward, logp, source="agent1"):
        return Trajectory(prompt_id=pid, source=source, prompt_text="q", response_text=text, token_ids=(1, 2),
                          finish_reason="eos", reward=reward, source_len=3).with_logp(logp)

    trajs = [traj("p1", "b", 0.0, -2.0), traj("p0", "a", 1.0, -1.0), traj("p1", "c", 1.0, -3.0)]
    record = PeerRecord.from_trajectories(run_id="run-a", step=4, agent="agent1", weights_version=3,
                                          prompt_ids=["p0", "p1"], trajectories=trajs, positive_rate=2 / 3)
    assert record.responses == (("a",), ("b", "c"))
    assert record.rewards == ((1.0,), (0.0, 1.0)) and record.logp_sums == ((-1.0,), (-2.0, -3.0))
    assert record.lengths == ((3,), (3, 3)) and record.finish_reasons == (("eos",), ("eos", "eos"))
    with pytest.raises(ValueError, match="trajectory of 'agent2'"):
        PeerRecord.from_trajectories(run_id="run-a", step=4, agent="agent1", weights_version=3, prompt_ids=["p0"],
                                     trajectories=[traj("p0", "a", 1.0, -1.0, "agent2")], positive_rate=1.0)
    unfilled = Trajectory(prompt_id="p0", source="agent1", prompt_text="q", response_text="a", token_ids=(1,),
                          finish_reason="eos", reward=1.0, source_len=2)  # no π_old sum yet: NaN
    with pytest.raises(ValueError, match=r"logp_sums\[0\]\[0\]"):
        PeerRecord.from_trajectories(run_id="run-a", step=4, agent="agent1", weights_version=3, prompt_ids=["p0"],
                                     trajectories=[unfilled], positive_rate=1.0)


def test_any_valid_record_round_trips_signed():
    """Arbitrary text (any code point but lone surrogates) and any float a valid record may hold (−0.0,
    subnormals, rewards in [0, 1], log-prob sums down to -1e4 per token) come back equal, and the
    signature still verifies after the JSON round trip."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)

    @st.composite
    def records(draw):
        sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        grid = lambda values: [[draw(values) for _ in range(g)] for g in sizes]  # noqa: E731
        responses = grid(text)
        tokens = [[draw(st.integers(len(t), 4096)) for t in row] for row in responses]  # >= 1 char per token
        finishes = grid(st.sampled_from(["eos", "length"]))
        lengths = [[draw(st.integers(1 if c + (f == "eos") else 0, c + (f == "eos"))) for c, f in zip(tr, fr)]
                   for tr, fr in zip(tokens, finishes)]
        sums = [[draw(st.floats(-1e4 * n, 0.0)) if n else 0.0 for n in row] for row in lengths]
        rewards = grid(st.floats(0.0, 1.0))
        flat = [r for row in rewards for r in row]
        step = draw(st.integers(0, 10**9))
        return PeerRecord(run_id="run-a", step=step, agent="agent1", weights_version=draw(st.integers(0, step)),
                          prompt_ids=[f"p{i}" for i in range(len(sizes))], responses=responses,
                          finish_reasons=finishes, rewards=rewards, logp_sums=sums, lengths=lengths,
                          response_tokens=tokens, positive_rate=sum(r > 0 for r in flat) / len(flat),
                          config_digest=draw(st.text(alphabet="0123456789abcdef:sha", max_size=80)),
                          config_fields=draw(st.dictionaries(st.sampled_from(["data.task", "hacpo.alpha"]),
                                                             st.text(alphabet="0123456789abcdef", min_size=1,
                                                                     max_size=16))),
                          run_nonce=draw(st.text(alphabet="0123456789abcdef", max_size=32)))

    @settings(max_examples=30, deadline=None)
    @given(records())
    def check(record):
        back = parse(record.to_json(KEY), step=record.step, key=KEY)
        assert back == record
        assert [math.copysign(1, v) for g in back.rewards for v in g] == \
            [math.copysign(1, v) for g in record.rewards for v in g]  # −0.0 keeps its sign

    check()
