"""The experience service's forwards with per-run LoRA adapters (services/experience/workers/adapters.py) on
SmolLM2-135M in float32.

Two adapters are built here with peft (rank 8 on q_proj/v_proj, A and B drawn from seeded generators so that they
change the log-probs) on a model of our own, and loaded into an :class:`AdapterForwards` over the service's
reference model. Each run's rows, in every forward layout, get the log-probs of an independent peft forward with
that run's adapter (full logits, log-softmax) and, as reference, those of the plain base model; a new version of A
changes A only; a bad adapter is refused and A keeps its log-probs; removing the adapters gives the base back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.generation import CompletionRecord
from services.common.lora import AdapterConfig, expected_tensors
from services.experience.config import PromptSpec
from services.experience.workers.adapters import AdapterForwards
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.sequences import build_rollout

pytestmark = pytest.mark.smollm2

CONFIG = AdapterConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
MAX_RANK = 16
#: Against the independent peft model run through the same chunks (LogProbModel): what differs is the adapter alone.
TOLERANCE = 1e-5
#: Against each row forwarded alone (full logits, log-softmax): the base-model path itself differs from that by up
#: to 2.2e-5 on these rows in float32 (other matmul shapes, the attention mask, logits_to_keep), adapters or not.
WHOLE_TOLERANCE = 5e-5
#: (prompt, responses) per run: run A has a group of two and a single row; run B a group of three.
RUNS = {
    "a": [("The capital of France is", [" Paris, on the Seine.", " a city of light"]),
          ("Write a haiku about the sea:", [" Waves fold on grey stone,\nsalt wind"])],
    "b": [("Two plus two equals", [" four.", " 4, of course, as every child learns.", " five"])],
}
LAYOUTS = {"padded": {"packed": False}, "packed": {"packed": True},
           "shared_prompt": {"packed": True, "share_prompt": True}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: on shared cores two OpenMP threads wait on each other at every barrier (a SmolLM2
    forward took 5 s instead of 0.18 s at load 6 on 2 cores). Log-probs do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def rows(smollm2_path):
    """Per run: its (prompt ids, response ids) rows and its Rollout (rows of a prompt consecutive)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    out = {}
    for run, groups in RUNS.items():
        specs, records, pairs = [], [], []
        for p, (prompt, responses) in enumerate(groups):
            prompt_ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
            specs.append(PromptSpec(prompt, prompt_ids, "", ""))
            for s, response in enumerate(responses):
                ids = tuple(tokenizer.encode(response, add_special_tokens=False))
                records.append(CompletionRecord(p, s, prompt_ids, ids, np.zeros(len(ids), np.float32), "stop", "", 0))
                pairs.append((prompt_ids, ids))
        out[run] = (pairs, build_rollout(records, specs, tokenizer.pad_token_id))
    return out


def whole_sequence_log_probs(model, pairs) -> list[torch.Tensor]:
    """Each row's response log-probs from a forward of the row alone (full logits, log-softmax)."""
    out = []
    with torch.no_grad():
        for prompt, response in pairs:
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
            out.append(torch.log_softmax(logits, dim=-1)[positions, torch.tensor(response)])
    return out


@pytest.fixture(scope="module")
def independent(smollm2_path, rows):
    """Our own model (float32): its plain log-probs taken before any adapter, then a peft model of its own.
    ``make`` adds an adapter with seeded A and B and returns its tensors as get_peft_model_state_dict names them;
    ``log_probs`` gives a run's rows through it with one adapter on, in a layout (:class:`LogProbModel` over the
    same chunks) or ``"whole"`` (each row alone, :func:`whole_sequence_log_probs`)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    def forward(model, run: str, layout: str):
        if layout == "whole":
            return whole_sequence_log_probs(model, rows[run][0])
        return LogProbModel(model).action_log_probs(chunks(rows[run][1], 2, **LAYOUTS[layout]))[0]

    plain = {(run, layout): forward(base, run, layout) for run in RUNS for layout in [*LAYOUTS, "whole"]}
    holder = {"peft": None}

    def make(key: str, config: AdapterConfig, seed: int) -> dict[str, torch.Tensor]:
        lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                          lora_dropout=0.0)
        if holder["peft"] is None:
            holder["peft"] = get_peft_model(base, lora, adapter_name=key)
        else:
            holder["peft"].add_adapter(key, lora)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in holder["peft"].modules():
                if hasattr(module, "lora_A") and key in module.lora_A:
                    a, b = module.lora_A[key].weight, module.lora_B[key].weight
                    a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
                    b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
        return {k: v.clone() for k, v in get_peft_model_state_dict(holder["peft"], adapter_name=key).items()}

    def log_probs(key: str, run: str, layout: str = "padded"):
        holder["peft"].set_adapter(key)
        return forward(holder["peft"].base_model.model, run, layout)

    adapters = {"a": make("first", CONFIG, seed=1), "b": make("second", CONFIG, seed=2)}
    return {"plain": plain, "make": make, "log_probs": log_probs, "adapters": adapters}


@pytest.fixture(scope="module")
def service_base(smollm2_path):
    """The service's reference model, as the experience service loads it."""
    return LogProbModel.load(smollm2_path, dtype="float32", device="cpu")


@pytest.fixture
def forwards(service_base, independent):
    """Adapters a and b loaded at version 1; every adapter removed afterwards (the module is the base again)."""
    adapters = AdapterForwards(service_base, max_rank=MAX_RANK)
    for name, tensors in independent["adapters"].items():
        adapters.load(name, CONFIG, tensors, version=1)
    yield adapters
    for name in list(adapters.adapters()):
        adapters.remove(name)


def assert_rows(actual: torch.Tensor, expected, tolerance: float = TOLERANCE) -> None:
    """``actual`` (B, A) equals ``expected`` on each row's response: (B, A) of the same layout, or a list of the
    rows' response log-probs (whole-sequence forwards)."""
    assert actual.shape[0] == len(expected)
    for row, want in zip(actual, expected, strict=True):
        got = row[: len(want)] if isinstance(expected, list) else row
        assert torch.allclose(got, want, atol=tolerance, rtol=0), (got - want).abs().max()


def run_log_probs(forwards, rows, name: str, run: str, layout: str = "padded", **kwargs):
    return forwards.log_probs(name, chunks(rows[run][1], 2, **LAYOUTS[layout]), **kwargs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_runs_rows_get_its_adapter_and_the_base_as_reference(forwards, rows, independent, layout):
    for run, key in (("a", "first"), ("b", "second")):
        out = run_log_probs(forwards, rows, run, run, layout, with_entropy=True)
        assert_rows(out.action_log_probs, independent["log_probs"](key, run, layout))
        assert_rows(out.action_log_probs, independent["log_probs"](key, run, "whole"), WHOLE_TOLERANCE)
        assert_rows(out.base_action_log_probs, independent["plain"][run, layout])
        assert_rows(out.base_action_log_probs, independent["plain"][run, "whole"], WHOLE_TOLERANCE)
        assert out.entropy.shape == out.action_log_probs.shape
        mask = rows[run][1].action_mask
        assert (out.action_log_probs - out.base_action_log_probs)[mask].abs().max() > 1e-2  # the adapter matters
    other = run_log_probs(forwards, rows, "b", "a", layout)  # run a's rows under b's adapter: b's numbers
    assert_rows(other.action_log_probs, independent["log_probs"]("second", "a", layout))


def test_the_module_rests_with_adapters_off(forwards, rows, independent, service_base):
    """The reference's own forward (base-model runs) still computes the base with adapters loaded."""
    run_log_probs(forwards, rows, "a", "a")
    plain, _ = service_base.action_log_probs(chunks(rows["a"][1], 2, packed=False))
    assert_rows(plain, independent["plain"]["a", "padded"])
    without = run_log_probs(forwards, rows, "a", "a", with_reference=False)
    assert without.base_action_log_probs is None and without.entropy is None


def test_a_new_version_of_one_adapter_leaves_the_other_unchanged(forwards, rows, independent):
    b_before = run_log_probs(forwards, rows, "b", "b").action_log_probs
    a_before = run_log_probs(forwards, rows, "a", "a").action_log_probs
    loaded = forwards.load("a", CONFIG, independent["make"]("first_v2", CONFIG, seed=3), version=2)
    assert loaded.version == 2 and forwards.adapters()["b"].version == 1
    a_after = run_log_probs(forwards, rows, "a", "a").action_log_probs
    assert_rows(a_after, independent["log_probs"]("first_v2", "a"))
    assert not torch.allclose(a_after, a_before, atol=1e-3)
    assert torch.equal(run_log_probs(forwards, rows, "b", "b").action_log_probs, b_before)
    # another config (rank 4 on every attention projection): new LoRA layers for a, b's kept as they were
    wider = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    forwards.load("a", wider, independent["make"]("first_wide", wider, seed=4), version=3)
    assert_rows(run_log_probs(forwards, rows, "a", "a").action_log_probs, independent["log_probs"]("first_wide", "a"))
    assert torch.equal(run_log_probs(forwards, rows, "b", "b").action_log_probs, b_before)


def bad_adapters(tensors: dict[str, torch.Tensor], modules) -> dict[str, tuple]:
    """Each bad load: (config, tensors, the field the refusal names)."""
    first = next(iter(tensors))
    b_name = next(name for name in tensors if ".lora_B." in name)
    over = AdapterConfig(rank=MAX_RANK * 2, alpha=16.0, target_modules=("q_proj", "v_proj"))
    return {
        "unknown name": (CONFIG, {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 576)},
                         "tensors[base_model.model.lm_head.lora_A.weight]"),
        "wrong shape": (CONFIG, {**tensors, b_name: torch.zeros(tensors[b_name].shape[0], 4)}, f"tensors[{b_name}]"),
        "integer dtype": (CONFIG, {**tensors, first: tensors[first].to(torch.int64)}, f"tensors[{first}]"),
        "not finite": (CONFIG, {**tensors, b_name: torch.full_like(tensors[b_name], float("nan"))},
                       f"tensors[{b_name}]"),
        "missing": (CONFIG, {k: v for k, v in tensors.items() if k != b_name}, f"tensors[{b_name}]"),
        "rank over the limit": (over, {k: torch.zeros(s) for k, s in expected_tensors(over, modules).items()},
                                "config.rank"),
        "no target": (AdapterConfig(8, 16.0, ("lm_head",)), {}, "config.target_modules"),
    }


@pytest.mark.parametrize("case", ["unknown name", "wrong shape", "integer dtype", "not finite", "missing",
                                  "rank over the limit", "no target"])
def test_a_bad_adapter_is_refused_and_the_old_one_still_serves(forwards, rows, independent, case):
    before = run_log_probs(forwards, rows, "a", "a").action_log_probs
    tensors = independent["make"](f"bad_{case.replace(' ', '_')}", CONFIG, seed=5)  # valid, spoiled below
    config, bad, field = bad_adapters(tensors, forwards.modules())[case]
    with pytest.raises(InvalidRequest) as refused:
        forwards.load("a", config, bad, version=2)
    assert refused.value.field == field
    assert forwards.adapters()["a"].version == 1
    assert torch.equal(run_log_probs(forwards, rows, "a", "a").action_log_probs, before)


def test_removing_adapters(forwards, rows, independent, service_base):
    assert forwards.remove("b") and not forwards.remove("b")
    with pytest.raises(InvalidRequest, match="no adapter named 'b'"):
        run_log_probs(forwards, rows, "b", "b")
    assert_rows(run_log_probs(forwards, rows, "a", "a").action_log_probs, independent["log_probs"]("first", "a"))
    assert forwards.remove("a") and forwards.adapters() == {}
    assert not [name for name, _ in service_base.module.named_modules() if "lora_" in name]  # unloaded
    plain, _ = service_base.action_log_probs(chunks(rows["a"][1], 2, packed=False))
    assert_rows(plain, independent["plain"]["a", "padded"])
    forwards.load("a", CONFIG, independent["adapters"]["a"], version=4)  # loads again after the last was removed
    assert_rows(run_log_probs(forwards, rows, "a", "a").action_log_probs, independent["log_probs"]("first", "a"))
