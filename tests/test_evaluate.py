"""tools/evaluate.py: lm-evaluation-harness straight on a tessera checkpoint, checked against lm-eval's own
Hugging Face backend (``hf``) run on ``tools/export_hf.py``'s export of the same checkpoint.

The checkpoint is a tiny byte-level model trained a few dozen steps on the task's facts (so that answers
are not near-ties), saved at TP=1 and converted offline to TP=2: the tool consolidates the TP=2 shards,
the export reads them too. Three local tasks (tests/data/lm_eval_tasks, no hub, no network) cover the
three request kinds: multiple choice (log-likelihood), perplexity (rolling log-likelihood) and greedy
generation (the KV cache). ``--max-length 24`` is shorter than the documents, so contexts are truncated on
the left and texts scored in several windows, in both backends.

Bound: the two backends run the same fp32 function in two summation orders. A logit differs by at most
``atol = order_rtol(fp32, n, depth) * max|logit|`` (tests/tolerances.py, as in test_interop.py), a log-prob
by at most ``2 * atol`` (log-softmax: the logit and the log-sum-exp), so a sum over ``k`` tokens by
``2 * k * atol``. Accuracy and exact match are compared exactly once every choice's margin exceeds twice
that bound (checked, so a near-tie is reported as such, never as a disagreement).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from harness.tools import run_tool
from tessera.data.tokenizer import ByteTokenizer
from tests.tolerances import order_rtol, transformer_depth

lm_eval = pytest.importorskip("lm_eval")
# the shared fixture trains, converts, exports and runs both evaluations (~45 s on 2 cores); lm-eval's task
# index alone takes ~10 s, so even the error-line test is over the quick run's ~20 s
pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm-eval's hf backend (the reference) needs it; tools/evaluate.py does not

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "data", "lm_eval_tasks")
TASK_NAMES = ["tiny_facts_mc", "tiny_facts_ppl", "tiny_facts_gen"]
MAX_LENGTH = 24


def _facts() -> list[dict]:
    with open(os.path.join(TASKS, "tiny_facts.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def offline():
    """No hub, no network: lm-eval and datasets read only the local task files."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, offline) -> dict:
    """configs/tiny.py's decoder (vocab 258 > the byte tokenizer's 257 ids, like the demo) trained 150 AdamW
    steps on the facts, saved at TP=1 by the training-time saver, converted to TP=2, exported to HF."""
    from tessera.checkpoint import Layout, Progress, TrainState, save_checkpoint
    from tessera.config import Config
    from tessera.model import build_model

    cfg = Config.from_file(os.path.join(ROOT, "configs", "tiny.py")).to_dict()
    cfg["model"]["vocab_size"] = 258
    cfg["data"]["type"] = "stdlib"  # the run's tokenizer is the byte tokenizer
    torch.manual_seed(0)
    model = build_model(cfg["model"], seed=0)
    tok = ByteTokenizer()
    rows = [[tok.eod_id, *tok.encode(f["text"])] for f in _facts()]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.eod_id] * (width - len(r)) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    work = tmp_path_factory.mktemp("evaluate")
    tp1 = save_checkpoint(str(work / "tp1"), 150, TrainState(model, progress=Progress(150)), config=cfg,
                          layout=Layout())
    run_tool("convert_checkpoint.py", tp1, str(work / "tp2"), "--tp", "2", "--dp", "1")
    tp2 = os.path.join(str(work / "tp2"), "step_150")
    hf = str(work / "hf")
    run_tool("export_hf.py", tp2, hf, "--dtype", "fp32")
    model.eval()
    with torch.no_grad():
        max_logit = model(ids).abs().max().item()
    a = model.args
    atol = order_rtol(torch.float32, max(a.vocab_size, a.hidden_size, a.ffn_hidden_size, MAX_LENGTH),
                      transformer_depth(a.num_layers)) * max_logit
    return {"tp2": tp2, "hf": hf, "work": work, "atol": atol}


def _by_doc(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def both(ckpt) -> tuple[dict, dict]:
    """(tools/evaluate.py's results on the TP=2 checkpoint, lm-eval's hf backend on the export), with samples."""
    from lm_eval.tasks import TaskManager

    out = os.path.join(str(ckpt["work"]), "ours.json")
    stdout = run_tool("evaluate.py", ckpt["tp2"], "--tasks", ",".join(TASK_NAMES), "--include-path", TASKS,
                      "--max-length", str(MAX_LENGTH), "--batch-size", "5", "--output", out, "--log-samples")
    assert "tiny_facts_mc" in stdout and "acc" in stdout  # the table
    with open(out, encoding="utf-8") as f:
        ours = json.load(f)
    theirs = lm_eval.simple_evaluate(model="hf", model_args=dict(pretrained=ckpt["hf"], dtype="float32",
                                                                 max_length=MAX_LENGTH),
                                     tasks=TASK_NAMES, task_manager=TaskManager(include_path=TASKS), device="cpu",
                                     batch_size=3, log_samples=True)
    return ours, theirs


def test_multiple_choice_scores_equal_the_hf_backend_on_the_export(both, ckpt):
    ours, theirs = both
    n_docs = len(_facts())
    for mine, ref in zip(_by_doc(ours, "tiny_facts_mc"), _by_doc(theirs, "tiny_facts_mc"), strict=True):
        got, want = mine["filtered_resps"], ref["filtered_resps"]  # [log-likelihood, is greedy] per choice
        for (lp, greedy), (lp_ref, greedy_ref), choice in zip(got, want, mine["doc"]["choices"], strict=True):
            bound = 2 * len(choice.encode()) * ckpt["atol"]
            assert abs(lp - lp_ref) <= bound, (mine["doc"]["question"], choice, lp, lp_ref, bound)
        ranked = sorted(lp for lp, _ in want)
        assert ranked[-1] - ranked[-2] > 2 * 2 * 8 * ckpt["atol"], "a near-tie: the comparison would be noise"
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_facts_mc"][metric] == theirs["results"]["tiny_facts_mc"][metric], metric
    assert ours["results"]["tiny_facts_mc"]["acc,none"] * n_docs >= n_docs // 2  # trained: not chance (1/3)


def test_rolling_loglikelihoods_and_perplexities_equal_the_hf_backend(both, ckpt):
    ours, theirs = both
    assert max(len(f["text"].encode()) for f in _facts()) > MAX_LENGTH  # some texts take two windows
    for mine, ref in zip(_by_doc(ours, "tiny_facts_ppl"), _by_doc(theirs, "tiny_facts_ppl"), strict=True):
        n = len(mine["doc"]["text"].encode())
        (lp,), (lp_ref,) = mine["filtered_resps"], ref["filtered_resps"]
        assert abs(lp - lp_ref) <= 2 * n * ckpt["atol"], (mine["doc"]["text"], lp, lp_ref)
    total = sum(len(f["text"].encode()) for f in _facts())
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = ours["results"]["tiny_facts_ppl"][metric], theirs["results"]["tiny_facts_ppl"][metric]
        # each is exp/scale of (sum of log-probs) / count: relative error at most the summed bound (+ its square)
        assert math.isclose(got, want, rel_tol=2 * 2 * total * ckpt["atol"]), (metric, got, want)


def test_greedy_generation_with_the_kv_cache_equals_the_hf_backend(both):
    ours, theirs = both
    got = [s["filtered_resps"][0] for s in _by_doc(ours, "tiny_facts_gen")]
    want = [s["filtered_resps"][0] for s in _by_doc(theirs, "tiny_facts_gen")]
    assert got == want
    assert any(g.strip() for g in got) and not any("." in g for g in got)  # stopped at (and cut) the stop string
    assert ours["results"]["tiny_facts_gen"] == theirs["results"]["tiny_facts_gen"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    """tools/evaluate.py's ``main(argv)`` in this process: (exit status, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("_evaluate_tool", os.path.join(ROOT, "tools", "evaluate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unknown_task_and_a_missing_lm_eval_are_one_error_line(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "no_checkpoint")  # both are reported before the checkpoint is read
    code, out, err = _run(capsys, missing, "--tasks", "no_such_task", "--include-path", TASKS)
    assert code == 1 and err.strip().splitlines()[-1] == "error: --tasks: lm-eval knows no task no_such_task", err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    code, out, err = _run(capsys, missing, "--tasks", "tiny_facts_mc")
    assert code == 1 and err.strip().splitlines() == [
        "error: tools/evaluate.py needs lm-evaluation-harness: pip install 'tessera[eval]' (the lm-eval package)"]


def _context_tasks(folder) -> str:
    """tiny_facts_mc with no question: its context empty (``tiny_empty_mc``) or only whitespace (``tiny_blank_mc``,
    which lm-eval turns into an empty context by moving the whitespace into the continuation)."""
    os.makedirs(folder)
    for name in ("tiny_tasks.py", "tiny_facts.jsonl"):
        with open(os.path.join(TASKS, name), encoding="utf-8") as src, open(os.path.join(folder, name), "w") as dst:
            dst.write(src.read())
    for task, text in (("tiny_empty_mc", ""), ("tiny_blank_mc", "  ")):
        with open(os.path.join(folder, f"{task}.yaml"), "w", encoding="utf-8") as f:
            f.write(f'task: {task}\ncustom_dataset: !function tiny_tasks.load_facts\ntest_split: test\n'
                    f'output_type: multiple_choice\ndoc_to_text: "{text}"\ndoc_to_choice: "{{{{choices}}}}"\n'
                    'doc_to_target: answer\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n')
    return str(folder)


def _hf_backend(ckpt, task: str, tasks: str) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="hf", model_args=dict(pretrained=ckpt["hf"], dtype="float32",
                                                               max_length=MAX_LENGTH),
                                   tasks=[task], task_manager=TaskManager(include_path=tasks), device="cpu",
                                   batch_size=3, log_samples=True)


def test_an_empty_context_is_scored_and_a_blank_one_refused_as_the_hf_backend_does(ckpt, tmp_path, capsys):
    """An empty context is conditioned on the end-of-document id (the export's eos), as lm-eval does; a context
    of only whitespace reaches the model empty, which lm-eval's hf backend refuses (an assertion): the tool
    refuses it too, in one line naming the task, instead of a line naming no task."""
    tasks = _context_tasks(tmp_path / "tasks")
    out = str(tmp_path / "ours.json")
    run_tool("evaluate.py", ckpt["tp2"], "--tasks", "tiny_empty_mc", "--include-path", tasks, "--max-length",
             str(MAX_LENGTH), "--batch-size", "5", "--output", out, "--log-samples")
    with open(out, encoding="utf-8") as f:
        ours = json.load(f)
    theirs = _hf_backend(ckpt, "tiny_empty_mc", tasks)
    for mine, ref in zip(_by_doc(ours, "tiny_empty_mc"), _by_doc(theirs, "tiny_empty_mc"), strict=True):
        for (lp, _), (lp_ref, _), choice in zip(mine["filtered_resps"], ref["filtered_resps"], mine["doc"]["choices"],
                                                strict=True):
            assert abs(lp - lp_ref) <= 2 * len(choice.encode()) * ckpt["atol"], (choice, lp, lp_ref)
    with pytest.raises(AssertionError):  # lm-eval 0.4.13: ``assert len(context_enc) > 0``
        _hf_backend(ckpt, "tiny_blank_mc", tasks)
    code, out_text, err = _run(capsys, ckpt["tp2"], "--tasks", "tiny_blank_mc", "--include-path", tasks)
    assert code == 1 and out_text == "", err
    assert err.strip().splitlines()[-1] == (
        "error: task tiny_blank_mc, document 0: a context of only whitespace ('  ') leaves no token to condition on "
        "once lm-eval moves its trailing whitespace into the continuation (lm-eval's hf backend refuses it too); "
        "make the task's doc_to_text give an empty context (scored after the end-of-document id) or put the "
        "whitespace in its target_delimiter"), err


def test_the_tokenizer_advice_names_the_vocabulary_the_checkpoint_embeds(tmp_path, capsys):
    """configs/tiny.py's model (256 ids, synthetic data: no tokenizer of its own) cannot take the byte tokenizer
    (257 ids: the end-of-document id would have no row); the advice says so instead of leading to a crash."""
    from tessera.checkpoint import Layout, Progress, TrainState, save_checkpoint
    from tessera.config import Config
    from tessera.model import build_model

    cfg = Config.from_file(os.path.join(ROOT, "configs", "tiny.py"))
    path = save_checkpoint(str(tmp_path / "ckpt"), 1, TrainState(build_model(cfg.model, seed=0),
                                                                 progress=Progress(1)),
                           config=cfg.to_dict(), layout=Layout())
    code, _, err = _run(capsys, path, "--tasks", "tiny_facts_mc", "--include-path", TASKS)
    assert code == 1 and err.strip().splitlines()[-1] == (
        "error: no tokenizer: data.type='synthetic' has no tokenizer; pass --tokenizer PATH/tokenizer.json|"
        "PATH/tokenizer.model of at most 256 ids (model.vocab_size=256; --tokenizer byte has 257 ids and needs "
        "model.vocab_size >= 257)"), err
    code, _, err = _run(capsys, path, "--tasks", "tiny_facts_mc", "--include-path", TASKS, "--tokenizer", "byte")
    assert code == 1 and err.strip().splitlines()[-1] == (
        "error: the tokenizer (--tokenizer byte) has 257 ids, more than model.vocab_size=256 embeds"), err
