"""The base's validation loss (issue 22, item 5): every validation block is scored (or a stated,
evenly spaced sample), and the figure is the same for 1 and 2 processes. Two processes are
simulated by two threads whose accelerator stand-ins sum their totals like a real reduce; the
multi-process build is in tests/e2e/test_distributed.py."""

from __future__ import annotations

import threading

import pytest
import torch

from nimmer_train.base.modeling import build_model
from nimmer_train.base.pretrain import evaluate, validation_indices
from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.config import ModelConfig, TrainConfig
from nimmer_train.voice.structured import end_of_turn_ids

SEQ = 16


class Ranks:
    """``world`` accelerator stand-ins whose reduce sums across them (a barrier, like all-reduce)."""

    def __init__(self, world: int) -> None:
        self.world, self.parts, self.barrier = world, [None] * world, threading.Barrier(world)

    def member(self, rank: int):  # noqa: ANN201
        ranks = self

        class Accelerator:
            process_index, num_processes, device = rank, ranks.world, torch.device("cpu")

            def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
                assert reduction == "sum"
                ranks.parts[rank] = tensor.clone()
                ranks.barrier.wait()
                total = sum(ranks.parts)
                ranks.barrier.wait()
                return total

        return Accelerator()


class Recording(torch.nn.Module):
    """The model, recording which blocks it was asked to score."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):  # noqa: ANN201
        self.seen += [tuple(row.tolist()) for row in input_ids]
        return self.model(input_ids=input_ids, labels=labels)


def _run(model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig, world: int) -> list[float]:
    ranks, out = Ranks(world), [0.0] * world

    def one(rank: int) -> None:
        out[rank] = evaluate(model, blocks, cfg, ranks.member(rank))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def model_and_blocks() -> tuple[torch.nn.Module, torch.Tensor]:
    cfg = ModelConfig(
        name="t", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = build_model(cfg, 96, 0, 1, seed=0).eval()
    blocks = torch.randint(2, 96, (197, SEQ), generator=torch.Generator().manual_seed(0))  # 25 batches
    return model, blocks


def test_every_block_is_scored_once_and_1_and_2_processes_agree(model_and_blocks) -> None:  # noqa: ANN001
    model, blocks = model_and_blocks
    cfg = TrainConfig(seq_len=SEQ, micro_batch_size=8, max_steps=10, warmup_steps=1)  # eval_batches: all
    with torch.no_grad():
        everything = (
            torch.stack([model(input_ids=b[None], labels=b[None]).loss for b in blocks]).mean().item()
        )
    for world in (1, 2):
        recording = Recording(model)
        values = _run(recording, blocks, cfg, world)
        assert values == [pytest.approx(everything, rel=1e-6)] * world  # every process reports the same
        scored = [row for row in recording.seen]
        assert sorted(set(scored)) == sorted(tuple(b.tolist()) for b in blocks)  # all 197 blocks
        assert len(scored) == len(blocks) + (1 if world == 2 else 0)  # rank 1 pads its 13th pass


def test_a_sample_is_evenly_spread_and_the_same_for_any_world() -> None:
    cfg = TrainConfig(seq_len=SEQ, micro_batch_size=4, max_steps=10, warmup_steps=1, eval_batches=5)
    picked = validation_indices(1000, cfg)
    assert len(picked) == 20 and picked[0] < 50 and picked[-1] > 950  # all of the set, every work
    assert list(validation_indices(10, cfg)) == list(range(10))


def test_end_of_turn_is_the_chat_templates_then_eos() -> None:
    tok = train_bpe(["Each soul to its station. " * 50] * 4, vocab_size=300, model_max_length=64)
    assert tok.convert_ids_to_tokens(end_of_turn_ids(tok)) == ["<|im_end|>", "<|endoftext|>"]
