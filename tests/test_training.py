"""Training stage (issue 2): data, anchors, overfitting, checkpoints (round trip, resume, clear
errors, atomic directories), the train/train.py CLI and 2-process data parallelism."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lilicorr import checkpoint as ckpt_io
from lilicorr.checkpoint import CheckpointError
from lilicorr.config import DrafterConfig, HeadConfig, LiLiCorrConfig, LossConfig, TrainConfig
from lilicorr.model import load_model
from lilicorr.target import TargetModel, load_target
from lilicorr.trainer import Trainer, cosine_with_warmup
from lilicorr.training import Sequence, collate, load_sequences, sample_anchors

from spec_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO / "train" / "train.py"
PROMPT, COMPLETION = 4, 36


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tiny_target_dir):
    return tiny_target_dir("llama")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


def greedy_sequences(target, n: int, seed: int = 0) -> list[list[int]]:
    """n sequences of PROMPT random tokens followed by COMPLETION greedy target tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, target.config.vocab_size, (n, PROMPT), generator=g)
    with torch.no_grad():
        for _ in range(COMPLETION):
            logits = target(ids, torch.arange(ids.shape[1]).expand(n, -1)).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids.tolist()


@pytest.fixture(scope="module")
def seq_ids(target):
    return greedy_sequences(target, 8)


@pytest.fixture(scope="module")
def data_file(seq_ids, tmp_path_factory):
    """Regen-format JSONL: {"id", "prompt_ids", "completion_ids"}."""
    path = tmp_path_factory.mktemp("data") / "regen.jsonl"
    with path.open("w") as f:
        for i, ids in enumerate(seq_ids):
            f.write(json.dumps({"id": f"s{i}", "prompt_ids": ids[:PROMPT], "completion_ids": ids[PROMPT:]}) + "\n")
    return path


def sequences(seq_ids, n=None) -> list[Sequence]:
    return [Sequence(ids, [0] * PROMPT + [1] * COMPLETION) for ids in seq_ids[:n]]


def make_cfg(target_cfg, **train) -> LiLiCorrConfig:
    tc = dict(lr_drafter=3e-3, lr_head=3e-3, global_batch=4, seq_len=64, epochs=1, num_anchors=12,
              max_steps=4, warmup_ratio=0.05, seed=0)
    tc.update(train)
    cfg = LiLiCorrConfig(
        drafter=DrafterConfig(num_layers=1, block_size=5, target_layer_ids=[0, 2]),
        head=HeadConfig(top_k=4, width=32, num_layers=1, num_heads=2, ffn_width=64, embed_dim=16),
        loss=LossConfig(), train=TrainConfig(**tc))
    cfg.drafter = cfg.drafter.for_target(target_cfg)
    return cfg


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_params(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def train_cli():
    return load_script(TRAIN_PY, "lilicorr_train_cli")


CLI_SMALL = ["--preset", "cpu", "--drafter-layers", "1", "--block-size", "5", "--num-anchors", "8",
             "--seq-len", "64", "--global-batch", "4", "--seed", "0", "--device", "cpu"]


# -- data and anchors --------------------------------------------------------------------------
def test_load_sequences_reads_regen_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    recs = [{"id": "a", "prompt_ids": [1, 2, 3], "completion_ids": [4, 5, 6, 7]},
            {"id": "b", "prompt_ids": [1], "completion_ids": [9]},                 # < 2 completion tokens
            {"id": "c", "prompt_ids": [], "completion_ids": list(range(10, 30))}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    seqs = load_sequences(path, seq_len=8)
    assert [s.ids for s in seqs] == [[1, 2, 3, 4, 5, 6, 7], list(range(10, 18))]
    assert seqs[0].loss_mask == [0, 0, 0, 1, 1, 1, 1] and seqs[1].loss_mask == [1] * 8
    ids, mask, lengths = collate(seqs, pad_id=0)
    assert ids.shape == (2, 8) and lengths.tolist() == [7, 8] and ids[0, 7] == 0 and not mask[0, 7]

    second = tmp_path / "e.jsonl"                          # several files (regen shards): concatenated in order
    second.write_text(json.dumps({"id": "d", "prompt_ids": [5], "completion_ids": [6, 7]}) + "\n")
    assert [s.ids for s in load_sequences([second, path], 8)] == [[5, 6, 7]] + [s.ids for s in seqs]
    with pytest.raises(FileNotFoundError, match="missing"):
        load_sequences([path, tmp_path / "missing.jsonl"], 8)

    path.write_text(json.dumps(recs[0]) + "\n" + json.dumps({"id": "x", "prompt": "text"}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2"):
        load_sequences(path, 8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sequences(tmp_path / "missing.jsonl", 8)


def test_sample_anchors_respects_mask_and_is_deterministic():
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 2:9] = True
    mask[2, :] = True
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(3)]  # noqa: E731
    anchors, valid = sample_anchors(mask, 6, gens())
    assert anchors.shape == (3, 6)
    for i in range(3):
        a = anchors[i][valid[i]]
        assert len(a) == 6 and torch.all(a[1:] > a[:-1])               # distinct, sorted
        assert torch.all(a >= 1) and torch.all(mask[i, a]) and torch.all(mask[i, a + 1])
    a2, v2 = sample_anchors(mask, 6, gens())
    assert torch.equal(anchors, a2) and torch.equal(valid, v2)
    # fewer eligible positions than requested: all of them, rest padded invalid
    anchors, valid = sample_anchors(mask, 100, gens())
    assert valid.sum(1).tolist() == [14, 6, 18]


def test_cosine_schedule_with_warmup():
    assert cosine_with_warmup(0, 100, 0.04) == pytest.approx(0.25)
    assert cosine_with_warmup(3, 100, 0.04) == pytest.approx(1.0)
    assert cosine_with_warmup(52, 100, 0.04) == pytest.approx(0.5)
    assert cosine_with_warmup(99, 100, 0.04) == pytest.approx(0.0, abs=1e-3)


# -- overfitting -------------------------------------------------------------------------------
def test_overfits_a_handful_of_sequences(target, seq_ids, tmp_path):
    cfg = make_cfg(target.config, max_steps=40, num_anchors=16)
    trainer = Trainer(cfg, target, sequences(seq_ids, 4), tmp_path / "ckpt", pad_id=0)
    hist = [trainer.train_step() for _ in range(cfg.train.max_steps)]
    first, last = hist[0], hist[-5:]
    loss_end = sum(r["total"] for r in last) / len(last)
    cov_end = sum(r["oracle_coverage"] for r in last) / len(last)
    tau_end = sum(r["tau_lilicorr"] for r in last) / len(last)
    assert loss_end < 0.5 * first["total"], (first["total"], loss_end)
    assert cov_end > first["oracle_coverage"] + 1.0, (first["oracle_coverage"], cov_end)  # of S = 4 slots
    assert tau_end > first["tau_lilicorr"] + 1.0
    for r in hist:
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("total", "dflash", "ce", "dist", "margin"))


# -- checkpoints -------------------------------------------------------------------------------
@pytest.fixture
def trained(target, seq_ids, tmp_path):
    """A trainer after 2 steps and its checkpoint directory."""
    cfg = make_cfg(target.config, max_steps=4)
    trainer = Trainer(cfg, target, sequences(seq_ids), tmp_path / "ckpt", pad_id=0)
    for _ in range(2):
        trainer.train_step()
    path = trainer.save()
    return trainer, path


def test_checkpoint_round_trip(trained, target):
    trainer, path = trained
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [ckpt_io.CONFIG, ckpt_io.WEIGHTS, ckpt_io.OPTIMIZER, ckpt_io.META])
    ck = ckpt_io.load_checkpoint(path, target.config)
    assert ck.cfg == trainer.cfg and ck.cfg.to_dict() == trainer.cfg.to_dict()
    assert ck.meta["step"] == 2 and len(ck.meta["history"]) == 2
    assert ck.target == ckpt_io.target_fingerprint(target.config)
    own = trainer.model.state_dict()
    assert set(ck.state) == set(own) and any(k.startswith("head.") for k in own)
    for k, v in own.items():
        assert ck.state[k].dtype == v.dtype and torch.equal(ck.state[k], v), k
    model = load_model(path, target)
    assert_same_params(params(model), params(trainer.model))
    one = sorted(own)[0]                              # reading a subset: those tensors only
    assert list(ckpt_io.load_state_dict(path, [one])) == [one]
    assert torch.equal(ckpt_io.load_state_dict(path, [one])[one], own[one])
    with pytest.raises(ckpt_io.CheckpointError, match="no tensor nope"):
        ckpt_io.load_state_dict(path, [one, "nope"])
    assert not any(p.requires_grad for p in model.parameters())


def test_resume_continues_identically(target, seq_ids, tmp_path):
    cfg = make_cfg(target.config, max_steps=4)
    seqs = sequences(seq_ids)
    straight = Trainer(cfg, target, seqs, tmp_path / "a", pad_id=0)
    for _ in range(4):
        straight.train_step()

    first = Trainer(cfg, target, seqs, tmp_path / "b", pad_id=0)
    for _ in range(2):
        first.train_step()
    first.save()
    del first
    second = Trainer(cfg, target, seqs, tmp_path / "b", pad_id=0)
    assert second.resume(tmp_path / "b") and second.state.step == 2
    for _ in range(2):
        second.train_step()
    assert second.state.step == 4 and len(second.state.history) == 4
    assert_same_params(params(second.model), params(straight.model))
    for a, b in zip(second.state.history, straight.state.history):
        assert a["total"] == pytest.approx(b["total"], rel=1e-6)
    assert not Trainer(cfg, target, seqs, tmp_path / "c", pad_id=0).resume(tmp_path / "c")   # nothing yet


def test_micro_batches_match_one_batch(target, seq_ids, tmp_path):
    """Gradient accumulation with global loss normalisation: same step as one big micro-batch."""
    cfg = make_cfg(target.config, max_steps=2)
    whole = Trainer(cfg, target, sequences(seq_ids), tmp_path / "a", pad_id=0)
    split = Trainer(cfg, target, sequences(seq_ids), tmp_path / "b", pad_id=0, micro_batch=1)
    grads = {}
    for name, tr in (("whole", whole), ("split", split)):
        def step(tr=tr, name=name, inner=tr.optimizer.step):     # record the gradient actually applied
            grads[name] = {k: p.grad.clone() for k, p in tr.model.named_parameters()}
            return inner()
        tr.optimizer.step = step
    for _ in range(2):
        ra, rb = whole.train_step(), split.train_step()
        assert ra["total"] == pytest.approx(rb["total"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-5)
        for k, g in grads["whole"].items():
            torch.testing.assert_close(grads["split"][k], g, rtol=1e-4, atol=1e-7, msg=k)
    # Adam divides by sqrt(v): last-bit gradient noise on near-zero entries moves weights ~1e-5
    assert_same_params(params(whole.model), params(split.model), atol=1e-4)


def test_truncated_weights_give_clear_error(trained, target):
    _, path = trained
    data = (path / ckpt_io.WEIGHTS).read_bytes()
    (path / ckpt_io.WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupt"):
        load_model(path, target)
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt_io.load_checkpoint(path)


@pytest.mark.parametrize("name", [ckpt_io.WEIGHTS, ckpt_io.CONFIG, ckpt_io.META])
def test_missing_file_gives_clear_error(trained, target, name):
    _, path = trained
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=rf"incomplete: {name} is missing"):
        load_model(path, target)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(path / "nope", target)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"lilicorr": {"drafter": {"bogus": 1}}}'])
def test_corrupt_config_gives_clear_error(trained, target, text):
    trainer, path = trained
    (path / ckpt_io.CONFIG).write_text(text)
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt"):
        load_model(path, target)
    with pytest.raises(CheckpointError, match=r"config\.json is corrupt"):
        trainer.resume(path)


def test_target_mismatch_gives_clear_error(trained, target):
    trainer, path = trained
    other = TargetModel(dataclasses.replace(target.config, vocab_size=target.config.vocab_size + 32))
    with pytest.raises(CheckpointError, match=r"another target \(vocab_size: checkpoint 96 vs target 128\)"):
        load_model(path, other)
    qwen = TargetModel(dataclasses.replace(target.config, model_type="qwen3", qk_norm=True))
    with pytest.raises(CheckpointError, match="model_type: checkpoint 'llama' vs target 'qwen3'"):
        load_model(path, qwen)
    t2 = Trainer(trainer.cfg, qwen, trainer.sequences, path, pad_id=0)
    with pytest.raises(CheckpointError, match="another target"):
        t2.resume(path)


def test_model_config_mismatch_on_resume_gives_clear_error(trained, target):
    trainer, path = trained
    cfg = make_cfg(target.config)
    cfg.head.width = 48
    with pytest.raises(CheckpointError, match="different model config"):
        Trainer(cfg, target, trainer.sequences, path, pad_id=0).resume(path)


def _listing(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_checkpoint_dirs_appear_atomically(trained, target):
    trainer, path = trained
    parent = path.parent
    before = _listing(parent)
    good = ckpt_io.load_checkpoint(path)

    bad_state = dict(trainer.model.state_dict())
    bad_state["drafter.unserialisable"] = object()                      # fails inside the weights write
    for dest in (parent / "fresh", path):
        with pytest.raises(Exception):
            ckpt_io.save_checkpoint(dest, trainer.cfg, bad_state, target.config, {"step": 9})
        assert _listing(parent) == before                               # no partial or temp dir left
    # a failure after the weights are on disk (optimizer state that cannot be pickled) too
    with pytest.raises(Exception):
        ckpt_io.save_checkpoint(parent / "fresh", trainer.cfg, trainer.model.state_dict(), target.config,
                                {"step": 9}, optimizer_state={"f": lambda: None})
    assert _listing(parent) == before
    # the old checkpoint is untouched
    again = ckpt_io.load_checkpoint(path)
    assert again.meta == good.meta and all(torch.equal(again.state[k], good.state[k]) for k in good.state)

    # a successful save replaces it whole, leaving no sibling behind
    trainer.train_step()
    trainer.save()
    assert _listing(parent) == before and ckpt_io.read_meta(path)["step"] == 3


def test_refuses_to_overwrite_a_folder_that_is_not_a_checkpoint(trained, target, tmp_path):
    trainer, _ = trained
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing"):
        trainer.save(precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert trainer.save(empty) == empty and (empty / ckpt_io.META).is_file()


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_vanilla_checkpoint_has_no_head(target_dir, data_file, tmp_path):
    out = tmp_path / "vanilla"
    assert train_cli().main(["--target", str(target_dir), "--data", str(data_file), "--out", str(out),
                             "--steps", "2", "--vanilla", *CLI_SMALL]) == 0
    ck = ckpt_io.load_checkpoint(out)
    assert ck.cfg.vanilla and ck.meta["step"] == 2
    assert ck.state and all(k.startswith("drafter.") for k in ck.state)
    assert not any(k.startswith("head.") for k in ck.state)
    log = [json.loads(line) for line in Path(f"{out}.log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and "ce" not in log[0]


def test_cli_margin_sets_mu_and_rho(target_dir, data_file, tmp_path, capsys):
    cli = train_cli()
    out = tmp_path / "margin"
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(out),
                     "--steps", "1", "--margin", *CLI_SMALL]) == 0
    doc = json.loads((out / ckpt_io.CONFIG).read_text())
    assert doc["lilicorr"]["loss"]["mu"] == 0.5 and doc["lilicorr"]["loss"]["rho"] == 2.0
    assert not doc["lilicorr"]["vanilla"]
    assert any(k.startswith("head.") for k in ckpt_io.load_state_dict(out))
    # rerunning on the finished checkpoint resumes with no retraining: no new step, no new log
    # line, the same weights and optimizer step; and a plain run is mu = 0
    log = Path(f"{out}.log.jsonl")
    log_before = log.read_text()
    assert len(log_before.splitlines()) == 1
    before = ckpt_io.load_checkpoint(out)
    capsys.readouterr()
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(out),
                     "--steps", "1", "--margin", *CLI_SMALL]) == 0
    assert "resumed at step 1" in capsys.readouterr().out
    assert log.read_text() == log_before
    after = ckpt_io.load_checkpoint(out)
    assert after.meta["step"] == before.meta["step"] == 1
    assert after.state.keys() == before.state.keys()
    assert all(torch.equal(after.state[k], before.state[k]) for k in before.state)
    plain = tmp_path / "plain"
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(plain),
                     "--steps", "1", *CLI_SMALL]) == 0
    assert json.loads((plain / ckpt_io.CONFIG).read_text())["lilicorr"]["loss"]["mu"] == 0.0


def test_cli_self_distillation_and_snapshots(target_dir, data_file, tmp_path):
    cli = train_cli()
    out = tmp_path / "distill"
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(out), "--steps", "3",
                     "--self-distill", "0.5", "--snapshot-every", "2", *CLI_SMALL]) == 0
    assert json.loads((out / ckpt_io.CONFIG).read_text())["lilicorr"]["loss"]["distill"] == 0.5
    # a weights-only snapshot at step 2, loadable like any checkpoint; none at step 1 or 3
    snaps = Path(f"{out}.snapshots")
    assert sorted(p.name for p in snaps.iterdir()) == ["step-00002"]
    snap = ckpt_io.load_checkpoint(snaps / "step-00002")
    assert snap.meta["step"] == 2 and not (snaps / "step-00002" / ckpt_io.OPTIMIZER).exists()
    assert snap.state.keys() == ckpt_io.load_checkpoint(out).state.keys()
    # the soft labels change the objective: the logged DFlash loss differs from a hard-label run
    hard = tmp_path / "hard"
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(hard), "--steps", "1",
                     *CLI_SMALL]) == 0
    first = [json.loads(Path(f"{d}.log.jsonl").read_text().splitlines()[0])["dflash"] for d in (out, hard)]
    assert first[0] != pytest.approx(first[1])
    assert cli.main(["--target", str(target_dir), "--data", str(data_file), "--out", str(tmp_path / "bad"),
                     "--self-distill", "2", *CLI_SMALL]) == 2


def test_cli_weight_decay_drafter(target_dir, data_file, tmp_path):
    cli = train_cli()
    base = ["--target", str(target_dir), "--data", str(data_file), "--steps", "1", *CLI_SMALL]
    out = tmp_path / "wd"
    assert cli.main([*base, "--out", str(out), "--weight-decay-drafter", "0.1"]) == 0
    assert json.loads((out / ckpt_io.CONFIG).read_text())["lilicorr"]["train"]["weight_decay_drafter"] == 0.1
    opt = torch.load(out / ckpt_io.OPTIMIZER, weights_only=False)["optimizer"]
    groups = {g["name"]: g for g in opt["param_groups"]}
    assert groups["drafter"]["weight_decay"] == 0.1 and groups["head"]["weight_decay"] == 0.01
    # the same data and seed without decay: the drafter's weights end elsewhere
    plain = tmp_path / "plain"
    assert cli.main([*base, "--out", str(plain)]) == 0
    w = "drafter.fc.weight"
    assert not torch.equal(ckpt_io.load_checkpoint(out).state[w], ckpt_io.load_checkpoint(plain).state[w])
    assert cli.main([*base, "--out", str(tmp_path / "bad"), "--weight-decay-drafter", "-1"]) == 2


def test_cli_init_starts_from_another_checkpoints_weights(target_dir, data_file, tmp_path, capsys):
    cli = train_cli()
    base = ["--target", str(target_dir), "--data", str(data_file), *CLI_SMALL]
    first = tmp_path / "first"
    assert cli.main([*base, "--out", str(first), "--steps", "2", "--draft-vocab", "40"]) == 0
    src = ckpt_io.load_checkpoint(first)
    # a new run from its weights: step 0 of a fresh schedule, the same model, vocabulary and weights;
    # the run's own --draft-vocab / --drafter-layers give way to the checkpoint's model
    grown = tmp_path / "grown"
    assert cli.main([*base, "--out", str(grown), "--steps", "1", "--init", str(first), "--draft-vocab", "64",
                     "--save-every", "1", "--snapshot-every", "1"]) == 0
    # its snapshot is named by total steps: the initial weights' 2 + this run's 1
    assert [p.name for p in Path(f"{grown}.snapshots").iterdir()] == ["step-00003"]
    log = [json.loads(line) for line in Path(f"{grown}.log.jsonl").read_text().splitlines()]
    assert len(log) == 1
    out = ckpt_io.load_checkpoint(grown)
    assert out.meta["step"] == 1 and out.meta["init"] == str(first) and out.meta["init_step"] == 2
    assert out.cfg.drafter == src.cfg.drafter and out.cfg.head == src.cfg.head
    assert out.meta["vocabulary"]["draft_vocab_size"] == 40 and 0 < out.meta["vocabulary"]["draft_coverage"] <= 1
    assert torch.equal(out.state["drafter.draft_to_target"], src.state["drafter.draft_to_target"])
    # one step of training moved the loaded weights a little, not from a fresh initialisation
    w = "drafter.fc.weight"
    moved = (out.state[w] - src.state[w]).abs().max()
    assert 0 < moved < 0.1 * src.state[w].abs().max()
    # the first step's loss is the trained model's, below a fresh model's first step
    fresh = [json.loads(line) for line in Path(f"{first}.log.jsonl").read_text().splitlines()]
    assert log[0]["dflash"] < fresh[0]["dflash"]
    # a run from that run's weights counts every step behind them: 2 + 1 + this run's 1
    again = tmp_path / "again"
    assert cli.main([*base, "--out", str(again), "--steps", "1", "--init", str(grown),
                     "--save-every", "1", "--snapshot-every", "1"]) == 0
    assert ckpt_io.read_meta(again)["init_step"] == 3
    assert [p.name for p in Path(f"{again}.snapshots").iterdir()] == ["step-00004"]
    # a vanilla run cannot start from a LiLiCorr checkpoint
    capsys.readouterr()
    assert cli.main([*base, "--out", str(tmp_path / "v"), "--steps", "1", "--vanilla", "--init", str(first)]) == 2
    assert "--vanilla" in capsys.readouterr().err


def _two_step_checkpoint(target_dir, data_file, out: Path):
    """train.py's entry point, its small common flags, and a checkpoint it trained for 2 steps at `out`."""
    cli = train_cli()
    base = ["--target", str(target_dir), "--data", str(data_file), *CLI_SMALL]
    assert cli.main([*base, "--out", str(out), "--steps", "2"]) == 0
    return cli, base, out


def test_cli_trains_a_head_of_another_shape_on_a_frozen_drafter(target_dir, data_file, tmp_path, capsys):
    cli, base, first = _two_step_checkpoint(target_dir, data_file, tmp_path / "first")
    src = ckpt_io.load_checkpoint(first)
    narrow = tmp_path / "narrow"
    assert cli.main([*base, "--out", str(narrow), "--steps", "2", "--init", str(first), "--freeze-drafter",
                     "--head-width", "64", "--head-ffn", "96", "--head-embed", "32", "--head-layers", "1",
                     "--head-heads", "2"]) == 0
    out = ckpt_io.load_checkpoint(narrow)
    want = dataclasses.replace(src.cfg.head, width=64, ffn_width=96, embed_dim=32, num_layers=1, num_heads=2)
    assert out.cfg.head == want and out.cfg.drafter == src.cfg.drafter and out.cfg.train.freeze_drafter
    assert out.meta["init_parts"] == "drafter"
    # the drafter is the initial checkpoint's, bit for bit; the head trained from a fresh start
    drafter_keys = [k for k in src.state if k.startswith("drafter.")]
    assert drafter_keys and all(torch.equal(out.state[k], src.state[k]) for k in drafter_keys)
    assert out.state["head.out_head.weight"].shape == (32, 64)
    log = [json.loads(line) for line in Path(f"{narrow}.log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and any(rec["grad_norm"] > 0 for rec in log)
    printed = capsys.readouterr().out
    assert "a fresh head on the drafter of --init" in printed and "drafter frozen" in printed
    # the same shape as the checkpoint's head: its head loads too, and trains on alone
    same = tmp_path / "same"
    assert cli.main([*base, "--out", str(same), "--steps", "1", "--init", str(first), "--freeze-drafter"]) == 0
    again = ckpt_io.load_checkpoint(same)
    assert "init_parts" not in again.meta
    assert all(torch.equal(again.state[k], src.state[k]) for k in drafter_keys)
    w = "head.out_head.weight"
    moved = (again.state[w] - src.state[w]).abs().max()
    assert 0 < moved < 0.1 * src.state[w].abs().max()
    # a frozen drafter needs one to start from, and a head to train; a head shape must divide
    capsys.readouterr()
    assert cli.main([*base, "--out", str(tmp_path / "a"), "--steps", "1", "--freeze-drafter"]) == 2
    assert "--init" in capsys.readouterr().err
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--steps", "1", "--head-width", "30",
                     "--head-heads", "4"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_cli_distils_a_narrow_head_from_a_wide_one(target_dir, data_file, tmp_path, capsys):
    cli, base, wide = _two_step_checkpoint(target_dir, data_file, tmp_path / "wide")
    src = ckpt_io.load_checkpoint(wide)
    # a head equal to its teacher (the same weights, nothing learned yet) has nothing to distil
    twin = tmp_path / "twin"
    assert cli.main([*base, "--out", str(twin), "--steps", "1", "--init", str(wide), "--freeze-drafter",
                     "--lr-head", "1e-12", "--distill-head", str(wide)]) == 0
    log = [json.loads(line) for line in Path(f"{twin}.log.jsonl").read_text().splitlines()]
    assert abs(log[0]["kd"]) < 1e-4
    # a fresh narrow head starts far from the teacher's rows and learns towards them
    narrow = tmp_path / "narrow"
    assert cli.main([*base, "--out", str(narrow), "--steps", "6", "--init", str(wide), "--freeze-drafter",
                     "--head-width", "64", "--head-ffn", "128", "--lr-head", "3e-3",
                     "--distill-head", str(wide), "--distill-weight", "4"]) == 0
    out = ckpt_io.load_checkpoint(narrow)
    assert out.cfg.head.width == 64 and out.cfg.loss.head_distill == 4.0
    assert out.meta["distill_head"] == str(wide)
    log = [json.loads(line) for line in Path(f"{narrow}.log.jsonl").read_text().splitlines()]
    assert log[0]["kd"] > 0.01 and log[-1]["kd"] < log[0]["kd"]
    assert all(torch.equal(out.state[k], src.state[k]) for k in src.state if k.startswith("drafter."))
    assert "distilling the head of" in capsys.readouterr().out
    # a teacher of another lattice (K), a vanilla run and a weight <= 0 are refused
    other_k = tmp_path / "other_k"
    assert cli.main([*base, "--out", str(other_k), "--steps", "1", "--top-k", "4"]) == 0
    assert cli.main([*base, "--out", str(tmp_path / "a"), "--steps", "1", "--distill-head", str(other_k)]) == 2
    assert "another lattice" in capsys.readouterr().err
    vanilla = tmp_path / "vanilla"
    assert cli.main([*base, "--out", str(vanilla), "--steps", "1", "--vanilla"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "--out", str(tmp_path / "v"), "--steps", "1", "--distill-head", str(vanilla)]) == 2
    assert "no head to distil" in capsys.readouterr().err
    assert cli.main([*base, "--out", str(tmp_path / "b"), "--steps", "1", "--vanilla",
                     "--distill-head", str(wide)]) == 2
    assert "--vanilla" in capsys.readouterr().err
    assert cli.main([*base, "--out", str(tmp_path / "c"), "--steps", "1", "--distill-head", str(wide),
                     "--distill-weight", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err


def test_cli_with_offline_feature_store(target_dir, data_file, tmp_path, capsys):
    cli = train_cli()
    feats = tmp_path / "features"
    base = ["--target", str(target_dir), "--data", str(data_file), "--steps", "1", "--features", str(feats),
            *CLI_SMALL]
    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 0
    assert (feats / "meta.json").is_file() and ckpt_io.read_meta(tmp_path / "a")["step"] == 1
    assert cli.main([*base, "--out", str(tmp_path / "b")]) == 0                # reuses the store
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "prompt_ids": [7, 8], "completion_ids": [9, 10, 11]}) + "\n")
    capsys.readouterr()
    rc = cli.main([*base[:2], "--data", str(other), *base[4:], "--out", str(tmp_path / "c")])
    assert rc == 2 and "does not match the training data" in capsys.readouterr().err


def test_feature_store_parallel_build_equals_serial(target_dir, data_file, tmp_path, monkeypatch):
    from lilicorr import features

    monkeypatch.setattr(features, "SHARD", 3)              # several shards from a few sequences
    target = load_target(target_dir)
    seqs = load_sequences(data_file, 64)
    assert len(seqs) > 2 * features.SHARD
    capture = [0, 1]
    seen = []
    one = features.build_feature_store(target, seqs, capture, tmp_path / "one")
    two = features.build_feature_store(target, seqs, capture, tmp_path / "two", workers=2, progress=seen.append)
    assert sum(seen) == len(seqs)
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    a = features.FeatureStore(one, target.config, capture, seqs)
    b = features.FeatureStore(two, target.config, capture, seqs)
    idx = list(range(len(seqs)))
    for x, y in zip(a.batch(idx, 64), b.batch(idx, 64)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="workers"):
        features.build_feature_store(target, seqs, capture, tmp_path / "bad", workers=0)


def test_feature_store_holds_each_sequences_own_features(target, seq_ids, tmp_path):
    """Sequences of different lengths are batched by length inside a shard; each stored entry is
    still that sequence's own target pass, run alone."""
    from lilicorr import features

    seqs = [Sequence(ids[:n], [0] * PROMPT + [1] * (n - PROMPT))
            for ids, n in zip(seq_ids, (40, 9, 31, 17, 40, 12, 25, 6, 33))]
    capture = [0, 1]
    store = features.FeatureStore(features.build_feature_store(target, seqs, capture, tmp_path / "f",
                                                               dtype=torch.float32), target.config, capture, seqs)
    for j, s in enumerate(seqs):
        captured, last, lse = store.batch([j], 40)                       # [1, 40, 2, H], [1, 40, H], [1, 40]
        n = len(s.ids)
        with torch.no_grad():
            out = target(torch.tensor([s.ids]), torch.arange(n)[None], capture=capture, logits=True)
        torch.testing.assert_close(captured[0, :n], out.captured[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last[0, :n], out.last_hidden[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[0, :n], torch.logsumexp(out.logits[0].float(), -1), atol=1e-4, rtol=1e-4)
        assert not captured[0, n:].any() and not lse[0, n:].any()        # zero right padding


def test_interrupted_feature_build_resumes_from_its_finished_shards(target_dir, data_file, tmp_path, monkeypatch):
    from lilicorr import features

    monkeypatch.setattr(features, "SHARD", 2)
    target = load_target(target_dir)
    seqs = load_sequences(data_file, 64)[:7]                          # shards of 2, 2, 2, 1
    capture = [0, 1]
    real_fill = features._fill_shards
    written = []

    def fill_then_die(target, sequences, capture, tmp, shard_ids, *args, **kw):
        real_fill(target, sequences, capture, tmp, shard_ids[:2], *args, **kw)
        written.extend(shard_ids[:2])
        (tmp / "shard-00002.safetensors").write_bytes(b"half a shard")  # a truncated older write
        raise KeyboardInterrupt

    monkeypatch.setattr(features, "_fill_shards", fill_then_die)
    with pytest.raises(KeyboardInterrupt):
        features.build_feature_store(target, seqs, capture, tmp_path / "f")
    partial = tmp_path / ".f.partial"
    assert not (tmp_path / "f").exists() and (partial / "plan.json").is_file()
    monkeypatch.setattr(features, "_fill_shards", lambda *a, **kw: (written.append(list(a[4])), real_fill(*a, **kw)))
    seen = []
    out = features.build_feature_store(target, seqs, capture, tmp_path / "f", progress=seen.append)
    assert written[-1] == [2, 3]                                      # only the unfinished shards ran
    assert sum(seen) == len(seqs) and not partial.exists()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json"] + [f"shard-{k:05d}.safetensors" for k in range(4)]
    clean = features.build_feature_store(target, seqs, capture, tmp_path / "clean")
    a = features.FeatureStore(out, target.config, capture, seqs)
    b = features.FeatureStore(clean, target.config, capture, seqs)
    for x, y in zip(a.batch(list(range(7)), 64), b.batch(list(range(7)), 64)):
        assert torch.equal(x, y)
    # a partial build of other data is not reused
    (partial).mkdir()
    (partial / "plan.json").write_text('{"other": 1}')
    (partial / "shard-00000.safetensors").write_bytes(b"x")
    features.build_feature_store(target, seqs[:3], capture, tmp_path / "f")
    assert features.FeatureStore(tmp_path / "f", target.config, capture, seqs[:3]).batch([0], 64)[0].shape[0] == 1


def test_stored_target_lse_gives_the_full_vocabulary_q(target_dir, data_file, tmp_path):
    """q_k from the stored log-normaliser (K dot products) equals log_softmax over the full vocabulary."""
    from lilicorr.features import FeatureStore, build_feature_store
    from lilicorr.model import LiLiCorrModel
    from lilicorr.training import training_forward

    target = load_target(target_dir)
    cfg = LiLiCorrConfig(drafter=DrafterConfig(num_layers=1, block_size=5, target_layer_ids=[0, 1]),
                         head=HeadConfig(top_k=8, width=32, num_layers=1, num_heads=2, ffn_width=64, embed_dim=16),
                         loss=LossConfig(mu=0.5), train=TrainConfig(num_anchors=6))
    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(0)
    model = LiLiCorrModel(cfg, target)
    seqs = load_sequences(data_file, 64)[:4]
    store = FeatureStore(build_feature_store(target, seqs, [0, 1], tmp_path / "f"), target.config, [0, 1], seqs)
    assert store.has_lse
    ids, mask, _ = collate(seqs, pad_id=0)
    feats = store.batch(list(range(len(seqs))), ids.shape[1])
    assert len(feats) == 3 and feats[2].shape == ids.shape
    anchors, valid = sample_anchors(mask, 6, [torch.Generator().manual_seed(i) for i in range(len(seqs))])
    with_lse = training_forward(model, target, ids, mask, anchors, valid, feats).terms
    full_vocab = training_forward(model, target, ids, mask, anchors, valid, feats[:2]).terms
    assert with_lse.num_supervised.item() > 0
    for name in ("ce_sum", "dist_sum", "margin_sum", "dflash_sum"):
        a, b = getattr(with_lse, name), getattr(full_vocab, name)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, a, b)
    assert with_lse.dist_sum.item() != 0.0


def test_cli_bad_data_path_gives_clear_error(target_dir, tmp_path, capsys):
    cli = train_cli()
    missing = tmp_path / "nope.jsonl"
    rc = cli.main(["--target", str(target_dir), "--data", str(missing), "--out", str(tmp_path / "o"),
                   "--steps", "1", *CLI_SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "--data" in err and str(missing) in err and "no such file" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("this is not json\n")
    rc = cli.main(["--target", str(target_dir), "--data", str(garbage), "--out", str(tmp_path / "o"),
                   "--steps", "1", *CLI_SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "garbage.jsonl:1: not a regenerated record" in err


# -- data parallel -----------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_process_run_matches_one_process(target_dir, data_file, tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    assert torchrun.exists(), torchrun
    # fp32: a W-rank run equals a 1-rank run up to summation order only without bf16 rounding
    args = ["--target", str(target_dir), "--data", str(data_file), "--steps", "3", "--lr-drafter", "1e-3",
            "--lr-head", "1e-3", "--precision", "fp32", *CLI_SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(TRAIN_PY),
                           *args, "--out", str(two)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout
    assert train_cli().main([*args, "--out", str(one)]) == 0

    a, b = ckpt_io.load_checkpoint(one), ckpt_io.load_checkpoint(two)
    assert a.cfg == b.cfg and a.meta["step"] == b.meta["step"] == 3
    assert_same_params(a.state, b.state, atol=1e-4)        # observed ~5e-7; a wrong normalisation ~4e-3
    for ra, rb in zip(a.meta["history"], b.meta["history"]):
        for key in ("total", "dflash", "ce", "dist", "oracle_coverage", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), key
    shutil.rmtree(one), shutil.rmtree(two)
