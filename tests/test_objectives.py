"""The run's tokenizer and objective: training a tokenizer on the run's text, packing, the
masked-LM / causal-LM / classification collators, the input pipeline's worker thread, and a
relay serving the tokenizer that peers fetch and verify (a changed file is refused)."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")

from relay_server.cli import main as cli_main  # noqa: E402
from relay_server.core.config import ConfigError, load_config  # noqa: E402
from relay_server.data.tokenizer_train import train_tokenizer  # noqa: E402
from tests.support.processes import write_config  # noqa: E402
from toolkit.client import RelayClient  # noqa: E402
from toolkit.corpus import demo_paragraphs, demo_texts  # noqa: E402
from toolkit.data import Background, ObjectiveConfig, batches_for_run, load_tokenizer, objective_batches  # noqa: E402
from toolkit.data.input_pipeline import check_run_data, peer_batches  # noqa: E402
from toolkit.data.objectives import IGNORE_INDEX, SPECIAL_TOKENS, Specials, encode_documents, mask_tokens, pack_blocks  # noqa: E402
from toolkit.errors import DataConfigError, ProtocolError  # noqa: E402
from toolkit.wire.protocol import ModelSpec, ParamSpec, RunInfo  # noqa: E402

pytestmark = pytest.mark.xdist_group("objectives")  # one worker builds its tokenizer once (--dist loadgroup)


@pytest.fixture(scope="module")
def tok_json() -> str:
    return train_tokenizer(demo_paragraphs(), vocab_size=1000).to_str()


@pytest.fixture(scope="module")
def tok(tok_json: str):
    return load_tokenizer(tok_json)


def mlm(**kw) -> ObjectiveConfig:
    return ObjectiveConfig.from_dict({"name": "masked-lm", **kw})


# --- the tokenizer --------------------------------------------------------------------------------
def test_tokenizer_trained_on_the_demo_text_has_the_mlm_special_tokens(tok) -> None:
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() == 1000
    enc = tok.encode("The assert statement")
    assert enc.tokens[0] == "[CLS]" and enc.tokens[-1] == "[SEP]"
    assert "The" in enc.tokens  # a frequent word of the corpus is one token
    paragraph = " ".join(demo_paragraphs()[1:20])
    assert len(tok.encode(paragraph).ids) < len(paragraph) / 2  # it learned more than characters
    assert tok.decode(enc.ids) == "The assert statement"


def test_cli_trains_a_loadable_tokenizer_named_by_the_config(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "run.toml",
        {
            "auth": {"mode": "open"},
            "tokenizer": {"file": "tok.json"},
            "objective": {"name": "masked-lm", "seq_len": 32},
        },
    )
    with pytest.raises(ConfigError, match="tokenizer.file"):  # not written yet
        load_config(config)
    assert cli_main(["tokenizer", "train", "--config", str(config), "--vocab-size", "600"]) == 0
    data = (tmp_path / "tok.json").read_bytes()
    assert load_tokenizer(data).get_vocab_size() == 600
    loaded = load_config(config)
    assert loaded.tokenizer.sha256 == hashlib.sha256(data).hexdigest()
    assert loaded.tokenizer.file == str((tmp_path / "tok.json").resolve())


def test_cli_trains_on_streamed_shards_through_the_reading_path(tmp_path: Path) -> None:
    shard = tmp_path / "a.jsonl"
    shard.write_text(
        "".join(json.dumps({"body": f"zebrafish quokka number {i}", "text": "unused"}) + "\n" for i in range(200))
    )
    config = write_config(
        tmp_path / "run.toml",
        {
            "auth": {"mode": "open"},
            "objective": {"name": "causal-lm", "column": "body"},
            "dataset": {"kind": "stream", "sources": [{"name": "a", "data_files": [str(shard)]}]},
        },
    )
    out = tmp_path / "out.json"
    assert (
        cli_main(
            ["tokenizer", "train", "--config", str(config), "--vocab-size", "300", "--model", "bpe", "--out", str(out)]
        )
        == 0
    )
    tok = load_tokenizer(out.read_bytes())
    assert tok.token_to_id("zebrafish") is not None and tok.token_to_id("unused") is None


@pytest.mark.parametrize("model", ["bpe", "unigram"])
def test_other_tokenizer_models_carry_the_special_tokens(model: str) -> None:
    tok = train_tokenizer(list(demo_paragraphs())[:300], vocab_size=400, model=model)
    assert Specials.of(tok).mask == 4 and Specials.of(tok).pad == 0


# --- packing --------------------------------------------------------------------------------------
def test_packing_cuts_exact_blocks_with_separators_and_keeps_the_tail() -> None:
    docs = [([1, 2, 3], [True] * 3), ([4, 5], [True, False]), ([6, 7, 8, 9, 10], [True] * 5)]
    blocks = list(pack_blocks(docs, 4, 99))
    assert [b[0] for b in blocks] == [[1, 2, 3, 99], [4, 5, 99, 6], [7, 8, 9, 10], [99]]
    assert blocks[1][1] == [True, False, True, True]


def test_masked_lm_batches_are_packed_cls_sep_blocks_and_the_tail_is_padded(tok) -> None:
    texts = list(demo_paragraphs())[:40]
    batches = list(objective_batches(iter(texts), tok, mlm(seq_len=64, mlm_probability=0.01), batch_size=4, seed=0))
    specials = Specials.of(tok)
    total = sum(len(ids) + 1 for ids, _ in encode_documents(tok, texts))  # + one [SEP] per document
    full = [b for b in batches[:-1]]
    assert all(b["attention_mask"].all() for b in full)
    for b in batches:
        assert set(b) == {"input_ids", "attention_mask", "labels"} and b["input_ids"].dtype == torch.long
        assert (b["input_ids"][:, 0] == specials.cls).all()
    last = batches[-1]
    real = last["attention_mask"].bool()
    assert not real.all(), "40 paragraphs do not fill whole batches: the tail is padded"
    assert (last["input_ids"][~real] == specials.pad).all() and (last["labels"][~real] == IGNORE_INDEX).all()
    assert (
        sum(int(b["attention_mask"].sum()) for b in batches)
        - 2 * sum(int(b["attention_mask"].any(dim=1).sum()) for b in batches)
        == total
    )  # every token once, 2 specials/block


# --- masking --------------------------------------------------------------------------------------
def test_masking_statistics_and_label_rules(tok) -> None:
    specials = Specials.of(tok)
    gen = objective_batches(demo_texts(7), tok, mlm(seq_len=128), batch_size=16, seed="peer-a")
    clean = objective_batches(
        demo_texts(7), tok, ObjectiveConfig.from_dict({"name": "causal-lm", "seq_len": 126}), batch_size=16, seed=0
    )
    counts = torch.zeros(4)
    for _ in range(12):
        batch, original = next(gen), next(clean)["input_ids"]
        ids, labels = batch["input_ids"], batch["labels"]
        body = ids[:, 1:-1]  # the same tokens as the causal stream: [CLS] body [SEP]
        predicted = labels != IGNORE_INDEX
        assert not predicted[:, 0].any() and not predicted[:, -1].any()
        special = torch.isin(original, torch.tensor(sorted(specials.all)))
        assert not predicted[:, 1:-1][special].any(), "special tokens are never masked"
        assert torch.equal(labels[:, 1:-1][predicted[:, 1:-1]], original[predicted[:, 1:-1]])
        p = predicted[:, 1:-1]
        counts += torch.tensor(
            [
                float((~special).sum()),
                float(p.sum()),
                float((body[p] == specials.mask).sum()),
                float((body[p] == original[p]).sum()),
            ]
        )
    eligible, masked, as_mask, kept = counts.tolist()
    assert masked / eligible == pytest.approx(0.15, abs=0.01)
    assert as_mask / masked == pytest.approx(0.8, abs=0.02)
    assert kept / masked == pytest.approx(0.1, abs=0.02)  # plus random draws that hit the same id (~0.1%)
    assert (masked - as_mask - kept) / masked == pytest.approx(0.1, abs=0.02)


def test_masking_is_seeded_per_peer(tok) -> None:
    def first(seed):
        return next(objective_batches(demo_texts(1), tok, mlm(seq_len=64), batch_size=4, seed=seed))["labels"]

    assert torch.equal(first("a"), first("a"))
    assert not torch.equal(first("a"), first("b"))


def test_random_replacements_are_never_special_tokens() -> None:
    ids = torch.full((64, 64), 7)
    inputs, labels = mask_tokens(
        ids,
        torch.zeros_like(ids, dtype=torch.bool),
        probability=0.5,
        mask_id=4,
        random_ids=torch.tensor([5, 6]),
        generator=torch.Generator().manual_seed(0),
    )
    swapped = inputs[(labels != IGNORE_INDEX) & (inputs != 4) & (inputs != 7)]
    assert len(swapped) > 0 and set(swapped.tolist()) <= {5, 6}


def test_whole_word_masking_masks_every_piece_of_a_chosen_word(tok) -> None:
    gen = objective_batches(demo_texts(3), tok, mlm(seq_len=128, whole_word_masking=True), batch_size=8, seed=1)
    plain = objective_batches(
        demo_texts(3), tok, ObjectiveConfig.from_dict({"name": "causal-lm", "seq_len": 126}), batch_size=8, seed=0
    )
    pieces = 0
    for _ in range(4):
        predicted = (next(gen)["labels"] != IGNORE_INDEX)[:, 1:-1]
        ids = next(plain)["input_ids"]
        cont = torch.tensor([[tok.id_to_token(int(i)).startswith("##") for i in row] for row in ids])
        # a continuation piece ("##x") is predicted exactly when the piece before it is
        both = cont[:, 1:]
        assert torch.equal(predicted[:, 1:][both], predicted[:, :-1][both])
        pieces += int((predicted[:, 1:] & both).sum())
    assert pieces > 0


def test_causal_lm_labels_are_the_inputs_and_ignore_padding(tok) -> None:
    obj = ObjectiveConfig.from_dict({"name": "causal-lm", "seq_len": 50})
    batches = list(objective_batches(iter(list(demo_paragraphs())[:10]), tok, obj, batch_size=3, seed=0))
    for b in batches:
        real = b["attention_mask"].bool()
        assert torch.equal(b["labels"][real], b["input_ids"][real]) and (b["labels"][~real] == IGNORE_INDEX).all()
    assert not batches[-1]["attention_mask"].all()


def test_classification_rows_are_truncated_padded_and_labelled(tok) -> None:
    obj = ObjectiveConfig.from_dict({"name": "classification", "seq_len": 8})
    (b,) = objective_batches(iter([("the assert statement " * 10, 1), ("hi", 0)]), tok, obj, batch_size=2, seed=0)
    assert b["labels"].tolist() == [1, 0] and b["input_ids"].shape == (2, 8)
    assert b["attention_mask"][0].all() and b["attention_mask"][1].sum() < 8
    with pytest.raises(DataConfigError, match="text, label"):
        next(objective_batches(iter(["no label"]), tok, obj, batch_size=1, seed=0))


def test_objective_config_refuses_what_it_cannot_train() -> None:
    for bad in (
        {"name": "translation"},
        {"name": "masked-lm", "seq_len": 2},
        {"name": "masked-lm", "mlm_probability": 1.5},
        {"name": "masked-lm", "typo": 1},
        {"seq_len": 64},
    ):
        with pytest.raises(DataConfigError):
            ObjectiveConfig.from_dict(bad)


def test_batches_for_run_tokenizes_streamed_shards_with_the_objective_column(tmp_path: Path, tok) -> None:
    shard = tmp_path / "s.jsonl"
    shard.write_text("".join(json.dumps({"body": "The assert statement", "label": i % 2}) + "\n" for i in range(64)))
    dataset = {"kind": "stream", "shuffle_buffer": 1, "sources": [{"name": "s", "data_files": [str(shard)]}]}
    stream = batches_for_run(
        dataset,
        batch_size=4,
        seq_len=0,
        seed=0,
        tokenizer=tok,
        objective=ObjectiveConfig.from_dict({"name": "classification", "seq_len": 8, "column": "body"}),
    )
    batch = next(stream)
    stream.close()
    assert batch["labels"].tolist() == [0, 1, 0, 1]
    assert tok.decode(batch["input_ids"][0].tolist()) == "The assert statement"


# --- the input pipeline's worker ------------------------------------------------------------------
def test_background_runs_the_source_on_its_own_thread_and_raises_its_errors() -> None:
    threads: list[str] = []

    def source():
        try:
            for i in range(3):
                threads.append(threading.current_thread().name)
                yield i
            raise DataConfigError("boom", "broken shard")
        finally:
            threads.append("closed")

    stream = Background(source(), depth=1)
    assert [next(stream) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataConfigError, match="broken shard"):
        next(stream)
    stream.close()
    assert threading.current_thread().name not in threads[:3] and threads[-1] == "closed"

    endless = Background(iter(int, 1), depth=2)  # never ends: close() must stop it
    next(endless)
    endless.close(timeout_s=5)
    assert not endless._thread.is_alive()


# --- the run: relay config, route, peer verification ----------------------------------------------
def _run_info(**kw) -> RunInfo:
    kw.setdefault("model", ModelSpec())
    return RunInfo(
        run_name="r",
        protocol=3,
        layout=[ParamSpec(name="w", shape=[1], offset=0)],
        num_params=1,
        target_batch=1,
        total_steps=0,
        max_staleness=0,
        heartbeat_interval_s=1.0,
        **kw,
    )


def test_a_transformers_run_without_tokenizer_and_objective_is_refused() -> None:
    with pytest.raises(DataConfigError, match="nothing to turn its text into tokens") as err:
        check_run_data(
            _run_info(
                model=ModelSpec(
                    kind="transformers", architecture="AutoModelForMaskedLM", config={"model_type": "bert"}
                )
            )
        )
    assert "data=" in err.value.hint and "[objective]" in err.value.hint
    with pytest.raises(DataConfigError, match="no tokenizer"):
        check_run_data(_run_info(objective={"name": "masked-lm"}))
    assert check_run_data(_run_info()) is None  # the byte-level demo model keeps its byte stream


def test_relay_config_checks_the_tokenizer_against_objective_and_model(tmp_path: Path, tok_json: str) -> None:
    (tmp_path / "tok.json").write_text(tok_json)
    base = {"auth": {"mode": "open"}}
    with pytest.raises(ConfigError, match="needs \\[tokenizer\\]"):
        load_config(write_config(tmp_path / "a.toml", {**base, "objective": {"name": "masked-lm"}}))
    with pytest.raises(ConfigError, match="sha256"):
        load_config(write_config(tmp_path / "b.toml", {**base, "tokenizer": {"file": "tok.json", "sha256": "0" * 64}}))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_config(
            write_config(
                tmp_path / "c.toml",
                {
                    **base,
                    "tokenizer": {"file": "tok.json"},
                    "objective": {"name": "masked-lm"},
                    "model": {
                        "kind": "transformers",
                        "architecture": "AutoModelForMaskedLM",
                        "config": {"model_type": "bert", "vocab_size": 100},
                    },
                },
            )
        )


def test_relay_serves_the_tokenizer_and_the_peer_verifies_it(tmp_path: Path, tok_json: str, serve_relay) -> None:
    (tmp_path / "tok.json").write_text(tok_json)
    relay = serve_relay({"tokenizer": {"file": "tok.json"}, "objective": {"name": "masked-lm", "seq_len": 32}})
    client = RelayClient(relay.url, retries=0)
    try:
        run = client.get_run()
        assert run.tokenizer_sha256 == hashlib.sha256(tok_json.encode()).hexdigest()
        assert run.objective == {"name": "masked-lm", "seq_len": 32}
        assert client.get_tokenizer(run.tokenizer_sha256) == tok_json.encode()
        with pytest.raises(ProtocolError, match="sha256") as err:
            client.get_tokenizer("f" * 64)  # the file the run published is not the one served
        assert err.value.code == "tokenizer_mismatch"
        batches = peer_batches(run, client, "peer-1", batch_size=2, seed=0)
        try:
            batch = next(batches)
        finally:
            batches.close()
        assert batch["input_ids"].shape == (2, 32) and (batch["labels"] != IGNORE_INDEX).any()
    finally:
        client.close()


def test_a_peer_joins_a_transformers_mlm_run_and_trains_on_its_tokens(
    tmp_path: Path, tok_json: str, serve_relay
) -> None:
    pytest.importorskip("transformers")
    from toolkit.session import join

    (tmp_path / "tok.json").write_text(tok_json)
    bert = {
        "model_type": "bert",
        "vocab_size": 1000,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    }
    relay = serve_relay(
        {
            "run": {"target_batch": 4, "total_steps": 2, "max_staleness": 0},
            "model": {"kind": "transformers", "architecture": "AutoModelForMaskedLM", "config": bert},
            "tokenizer": {"file": "tok.json"},
            "objective": {"name": "masked-lm", "seq_len": 32},
        }
    )
    result = join(relay.url, batch_size=4, panel="none", max_seconds=120)
    assert result.finished and result.final_step == 2 and result.contributed_samples > 0
    assert 3.0 < result.last_loss < 10.0  # cross-entropy over a 1,000-token vocabulary, not bytes
