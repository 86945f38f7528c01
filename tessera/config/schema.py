"""The config schema: every key, its accepted types, default and range, as one tree (``SCHEMA``).

The model section's defaults are ``ModelArgs``'s own (``tessera.model.args``), so the config and a
model built from a partial dict agree; config-only model keys (dtype, fp32 marks, ...) keep theirs here.
Checks that involve several keys live in ``tessera.config.checks``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.config.dtypes import parse_dtype
from tessera.config.errors import ConfigError
from tessera.model.args import ModelArgs
from tessera.model.compile import BACKENDS as COMPILE_BACKENDS
from tessera.model.compile import MODES as COMPILE_MODES
from tessera.model.rotary import rope_scaling_problem
from tessera.parallel.gemm import BACKENDS as FP8_BACKENDS
from tessera.parallel.gemm import GEMM_RECIPES, KEEP_HIGH, SCALE_ROUNDINGS, gemm_recipes
from tessera.parallel.sequence import TENSOR_MODES

__all__ = ["Key", "Section", "OneOf", "SCHEMA", "default_of", "REQUIRED", "NORM_TYPES", "PRECISION_GROUPS",
           "DEFAULT_MEMORY_HEADROOM"]

REQUIRED: Any = object()  # the default of a key the file must set


@dataclass
class Key:
    """One config key: accepted types, default, and an optional range/choice check."""

    types: tuple[type, ...]
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None
    doc: str = ""
    nullable: bool = False


@dataclass
class Section:
    """A dict-valued key whose own keys are validated recursively."""

    keys: dict[str, Key | Section]
    doc: str = ""
    optional: bool = True  # may be absent from the file (then all defaults)
    extra: dict[str, Any] = field(default_factory=dict)


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _fraction(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


@dataclass(frozen=True)
class OneOf:
    """A key's check that accepts only ``choices``; introspectable, so the typed view's ``Literal`` of the key
    can be checked against it (``tests/test_config_typed.py``)."""

    choices: tuple[Any, ...]
    problem: str = ""  # the error text; default: the list of choices

    def __call__(self, v: Any) -> str | None:
        return None if v in self.choices else self.problem or f"must be one of {list(self.choices)}"


def _one_of(*choices: Any) -> OneOf:
    return OneOf(choices)


class GemmRecipeChoice(OneOf):
    """``model.low_precision.recipe``: the built-in recipes (``choices``, the typed view's ``Literal``) and any
    recipe a row added to the GEMM route table since (``tessera.parallel.gemm.add_route``), looked up when a config
    is read."""

    def __call__(self, v: Any) -> str | None:
        known = gemm_recipes()
        return None if v in known else f"must be one of {list(known)}"


def _size_or_all(v: Any) -> str | None:
    return None if v == -1 or v >= 1 else "must be -1 (whole data-parallel group) or >= 1"


def _checkpoint_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        return None if v == "selective" else "must be a bool, a fraction of layers in [0, 1] or 'selective'"
    return None if 0 <= v <= 1 else "must be a bool, a fraction of layers in [0, 1] or 'selective'"


def _dtype_value(v: Any) -> str | None:
    try:
        parse_dtype(v)
    except ConfigError as e:
        return str(e)
    return None


def _min_length_dict(v: Any) -> str | None:
    ok = all(isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0 for k, n in v.items())
    return None if ok else "must map path substrings (str) to minimum lengths (int >= 0)"


def _below_one(v: Any) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _off_or_at_least_two(v: Any) -> str | None:
    return None if v == 0 or v >= 2 else "must be 0 (none) or >= 2"


def _eval_seed(v: Any) -> str | None:
    return None if 0 <= v < 2**32 else "must be in [0, 2**32 - 1] (NumPy's seed range; lm-eval seeds NumPy)"


def _str_list(v: Any) -> str | None:
    return None if all(isinstance(x, str) for x in v) else "must be a list of strings"


LOW_PRECISION_PRESETS = ("nvidia", "torchtitan")  # model.low_precision.preset (tessera.config.presets)
FP8_KEEP_HIGH = KEEP_HIGH  # a model.low_precision.rules recipe that keeps the module in the model's dtype


def _fp8_rules(v: Any) -> str | None:
    choices = [*gemm_recipes(), *FP8_KEEP_HIGH]
    for rule in v:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            return f"must be a list of (pattern, recipe) pairs of strings, got {rule!r}"
        if rule[1] not in choices:
            return f"rule {tuple(rule)!r}: recipe must be one of {choices}"
    return None


NORM_TYPES = ("rmsnorm",)
PRECISION_GROUPS = ("module", "layer", "kind")  # metrics.precision_group (tessera.train.precision_telemetry)
DEFAULT_REDUCE_BUCKET_SIZE = 2**25  # elements (128 MiB of fp32 main grads), Megatron-sized
# the share of a device's memory a run does not plan to use: the CUDA context, kernels loaded on first use and
# the caching allocator's fragmentation. One figure for train.py's memory check and tools/plan.py
DEFAULT_MEMORY_HEADROOM = 0.1


def _headroom(v: Any) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1): the fraction of memory left unplanned"


_norm_type = OneOf(NORM_TYPES, f"only {list(NORM_TYPES)} is implemented (the decoder uses RMSNorm)")


def _rope_scaling(v: Any) -> str | None:
    return rope_scaling_problem(v)


_tensor_mode = OneOf(TENSOR_MODES)


_MODEL_ARG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelArgs)}


def _arg(name: str, types: tuple[type, ...], check: Callable[[Any], str | None] | None = None, *,
         doc: str = "", nullable: bool = False) -> Key:
    """A model key that ``ModelArgs`` has: its default is ``ModelArgs``'s (required when it has none)."""
    default = _MODEL_ARG_DEFAULTS[name]
    return Key(types, REQUIRED if default is dataclasses.MISSING else default, check, doc, nullable)


INT = (int,)
FLOAT = (float, int)
BOOL = (bool,)
STR = (str,)

SCHEMA = Section(
    {
        "job_name": Key(STR, "tessera", doc="name of the run; the log folder is log_folder/job_name"),
        "seed": Key(INT, 1024, _non_negative, doc="global seed (train.py --seed overrides)"),
        "log_folder": Key(STR, "runs", doc="metrics.jsonl, TensorBoard events and text logs go here"),
        "cudnn_deterministic": Key(BOOL, False),
        "deterministic": Key(BOOL, False, doc="the same config on the same machine gives the same losses bit for bit: "
                                             "deterministic kernels, cuBLAS workspace, cuDNN and NCCL settings "
                                             "(docs/compare-runs.md); what cannot be made so is refused"),
        "cudnn_benchmark": Key(BOOL, False),
        "dist": Section(
            {
                "timeout_s": Key(FLOAT, 1800, _positive, doc="collective timeout in seconds"),
                "backend": Key(STR, None, _one_of("nccl", "gloo"), nullable=True, doc="None: nccl on CUDA, else gloo"),
                "cpu_shm_allreduce": Key(STR, "auto", _one_of("auto", "on", "off"),
                                         doc="tensor-parallel all-reduces and all-gathers on CPU through shared memory "
                                             "instead of gloo when the TP group is on one machine; auto: unless its "
                                             "processes outnumber the cores"),
            }
        ),
        "model": Section(
            {
                # keys that ModelArgs has take their default from it (required where it has none)
                "num_layers": _arg("num_layers", INT, _positive),
                "hidden_size": _arg("hidden_size", INT, _positive),
                "num_attention_heads": _arg("num_attention_heads", INT, _positive),
                "num_kv_attention_heads": _arg("num_kv_attention_heads", INT, _positive, nullable=True,
                                               doc="None: = num_attention_heads"),
                "vocab_size": _arg("vocab_size", INT, _positive),
                "mlp_ratio": _arg("mlp_ratio", FLOAT, _positive),
                "multiple_of": _arg("multiple_of", INT, _positive,
                                    doc="SwiGLU hidden size is rounded up to a multiple of this"),
                "dtype": Key((str, torch.dtype), "torch.bfloat16", _dtype_value),
                "norm_type": Key(STR, "rmsnorm", _norm_type, doc="InternEvo's key; only 'rmsnorm' is implemented"),
                "layer_norm_epsilon": _arg("layer_norm_epsilon", FLOAT, _positive),
                "use_flash_attn": _arg("use_flash_attn", BOOL,
                                       doc="use the flash-attn package on CUDA when it is installed"),
                "checkpoint": _arg("checkpoint", (bool, float, int, str), _checkpoint_value,
                                   doc="activation checkpointing: True/False, a fraction of layers (full "
                                       "recomputation), or 'selective' (keep GEMM outputs, recompute the "
                                       "attention core and elementwise ops)"),
                "parallel_output": _arg("parallel_output", BOOL, doc="keep logits vocab-sharded for the parallel loss"),
                "tie_word_embeddings": _arg("tie_word_embeddings", BOOL),
                "rope_base": _arg("rope_base", FLOAT, _positive),
                "max_position_embeddings": Key(INT, None, _positive, nullable=True, doc="None: data.seq_len"),
                "init_std": _arg("init_std", FLOAT, _positive),
                "dropout": _arg("dropout", FLOAT, _fraction, doc="residual dropout (outside TP regions)"),
                "attn_dropout": _arg("attn_dropout", FLOAT, _fraction,
                                     doc="attention-probability dropout (inside TP regions)"),
                "bias": _arg("bias", BOOL, doc="biases on attention and MLP projections (on wo always; on q/k/v "
                                               "and the MLP unless qkv_bias / mlp_bias say otherwise)"),
                "qkv_bias": _arg("qkv_bias", BOOL, nullable=True,
                                 doc="biases on the q/k/v projections (Qwen2: qkv_bias=True, bias=False); "
                                     "None: as model.bias"),
                "mlp_bias": _arg("mlp_bias", BOOL, nullable=True,
                                 doc="biases on the MLP's w1/w3/w2 (InternLM, Llama with attention_bias alone: "
                                     "bias=True, mlp_bias=False); None: as model.bias"),
                "head_dim": _arg("head_dim", INT, _positive, nullable=True,
                                 doc="dims per attention head; None: hidden_size / num_attention_heads (Qwen3 and "
                                     "some Llama/Mistral checkpoints set it apart)"),
                "qk_norm": _arg("qk_norm", BOOL, doc="RMSNorm over head_dim on queries and keys before rotary "
                                                     "(Qwen3); its weight is shared by the heads"),
                "rope_scaling": _arg("rope_scaling", (dict,), _rope_scaling, nullable=True,
                                     doc="rotary frequency scaling, Hugging Face's parameters with a 'type': "
                                         "linear (factor), llama3 (factor, low_freq_factor, high_freq_factor, "
                                         "original_max_position_embeddings), yarn (factor, "
                                         "original_max_position_embeddings, optional attention_factor, beta_fast, "
                                         "beta_slow, mscale, mscale_all_dim, truncate); None: plain rotary"),
                "sliding_window": _arg("sliding_window", INT, _positive, nullable=True,
                                       doc="Mistral's attention window; tessera's attention is full causal, so a "
                                           "window shorter than data.seq_len is refused; None: no window"),
                "fp32_modules": Key((list, tuple), [], _str_list, doc="fnmatch patterns of module names kept fp32"),
                "use_fp32_norm": Key(BOOL, False, doc="keep every norm module fp32 (InternEvo's switch)"),
                "allow_reduced_precision_reduction": Key(
                    BOOL, False, doc="let cuBLAS reduce bf16/fp16 GEMM partial sums (split-K) in bf16/fp16, "
                                     "faster on some shapes; False: fp32, as the precision table promises"),
                "compile": Section(
                    {
                        "enabled": Key((bool, str), "auto", _one_of(True, False, "auto"),
                                       doc="run each decoder block's forward through torch.compile (from its second "
                                           "call on; generation stays eager); 'auto': on for CUDA, off on CPU, "
                                           "where compiling costs more than it saves in most runs (docs/compile.md)"),
                        "backend": Key(STR, "inductor", _one_of(*COMPILE_BACKENDS),
                                       doc="inductor generates fused kernels (on CPU it needs a C++ compiler); "
                                           "aot_eager / eager only trace (debugging)"),
                        "mode": Key(STR, "default", _one_of(*COMPILE_MODES), doc="inductor's mode"),
                    }
                ),
                "low_precision": Section(
                    {
                        "enabled": Key(BOOL, False, doc="low-precision GEMMs in the parallel linears (bf16 model "
                                                        "only): fp8 or a block format, as recipe and rules say"),
                        "recipe": Key(STR, "tensorwise", GemmRecipeChoice(GEMM_RECIPES),
                                      doc="fp8 with one scale per operand (tensorwise) or per row/column along the "
                                          "kept dims (rowwise); mxfp8 (E4M3, an E8M0 scale per 32) or nvfp4 (E2M1, "
                                          "an E4M3 scale per 16 and an fp32 one per tensor), emulated"),
                        "backend": Key(STR, "auto", _one_of(*FP8_BACKENDS),
                                       doc="the fp8 GEMMs' kernel: torch._scaled_mm (fp8 tensor cores) or fp32 GEMMs "
                                           "on dequantized operands (emulated); auto: scaled_mm on CUDA sm_89+, "
                                           "emulated elsewhere. Block recipes are emulated on every device"),
                        "exclude": Key((list, tuple), ["output"], _str_list,
                                       doc="fnmatch patterns of linears kept out of fp8 (fp32-marked ones always are)"),
                        "rules": Key((list, tuple), [], _fp8_rules,
                                     doc="(pattern, recipe) pairs: the first whose fnmatch pattern matches a linear's "
                                         "name gives its recipe (a GEMM recipe, or 'bf16'/'none' to keep it in the "
                                         "model dtype); unmatched linears take recipe; exclude applies first"),
                        "preset": Key(STR, None, _one_of(*LOW_PRECISION_PRESETS), nullable=True,
                                      doc="a published recipe's switches at once (tessera.config.presets): 'nvidia' "
                                          "(NVFP4 with 2D weights, Hadamard wgrad, stochastic gradients, first and "
                                          "last blocks bf16) or 'torchtitan' (NVFP4, the last 15% of blocks bf16); "
                                          "keys given beside it win"),
                        "mx_scale_rounding": Key(STR, "rceil", _one_of(*SCALE_ROUNDINGS),
                                                 doc="mxfp8's E8M0 block scale: rceil rounds the scale up (no element "
                                                     "saturates; NVIDIA's MXFP8 recipe, torchao's default), floor "
                                                     "rounds it down (OCP's rule: a block's largest element may clip)"),
                        "nvfp4_2d_weights": Key(BOOL, False,
                                                doc="nvfp4: weights in 16x16 blocks, so the forward and the data-"
                                                    "gradient GEMM see one quantized weight (TE: 2D quantization)"),
                        "hadamard_wgrad": Key(BOOL, False,
                                              doc="nvfp4: a 16-point random Hadamard transform (signs from the run's "
                                                  "seed) of the weight-gradient GEMM's operands along the tokens"),
                        "stochastic_gradients": Key(BOOL, False,
                                                    doc="block formats: gradients rounded stochastically (unbiased), "
                                                        "from a per-linear stream that checkpoints carry"),
                        "keep_first_blocks": Key(INT, 0, _non_negative,
                                                 doc="decoder blocks at the start kept in the model dtype"),
                        "keep_last_blocks": Key(INT, 0, _non_negative,
                                                doc="decoder blocks at the end kept in the model dtype"),
                        "high_precision_forward_from_step": Key(INT, None, _positive, nullable=True,
                                                                doc="from this optimizer step on, the forward GEMMs "
                                                                    "run in the model dtype (the backward stays in "
                                                                    "the recipe)"),
                    }
                ),
            },
            optional=False,
        ),
        "parallel": Section(
            {
                "tensor": Section(
                    {
                        "size": Key(INT, 1, _positive),
                        "mode": Key(STR, "mtp", _tensor_mode,
                                    doc="mtp: activations replicated over TP between layers; msp: sequence "
                                        "parallelism (norm/residual/dropout activations split along the "
                                        "sequence over TP; data.seq_len must divide by the TP size)"),
                    }
                ),
                "zero1": Section({"size": Key(INT, -1, _size_or_all)}),
                "pipeline": Section(
                    {"size": Key(INT, 1, _positive, doc="only 1: pipeline parallelism is not supported")}
                ),
            }
        ),
        "data": Section(
            {
                "seq_len": Key(INT, 2048, _positive),
                "micro_bsz": Key(INT, 1, _positive),
                "micro_num": Key(INT, 1, _positive, doc="micro-batches accumulated per optimizer step"),
                "total_steps": Key(INT, 1000, _positive),
                "type": Key(STR, "tokens", _one_of("tokens", "synthetic", "stdlib", "text"),
                            doc="tokens: prepared token folders; synthetic: random tokens; "
                                "stdlib: Python's own source; text: raw files (data.text), tokenized at start "
                                "into data.cache_folder exactly as tools/prepare_data.py would"),
                "train_folder": Key(STR, None, nullable=True,
                                    doc="type='tokens': a token folder; type='text': a raw file, a folder of them or "
                                        "a save_to_disk folder (what prepare_data.py --input takes)"),
                "valid_folder": Key(STR, None, nullable=True,
                                    doc="as train_folder, for validation (type='text': or hold documents out with "
                                        "data.text.valid_fraction / valid_every_nth)"),
                "cache_folder": Key(STR, "data_cache",
                                    doc="where type='stdlib' and type='text' keep the token files they make"),
                "valid_every": Key(INT, 0, _non_negative, doc="0: validate only at the end"),
                "valid_micro_num": Key(INT, 8, _positive),
                "valid_micro_bsz": Key(INT, None, _positive, nullable=True,
                                       doc="rows per validation forward; None: micro_bsz (no backward, so it "
                                           "can be larger)"),
                "valid_context_len": Key(INT, 0, _non_negative,
                                         doc="validation rows after a stream's first start this many tokens "
                                             "early; those are context, not scored (each token is still "
                                             "scored once, with at least this much of its document before it)"),
                "pack_sample_into_one": Key(BOOL, False, doc="True: positions do not restart per document"),
                "min_length": Key(INT, 0, _non_negative,
                                  doc="InternEvo's tokenized folders: documents shorter than this are left out"),
                "min_length_dict": Key((dict,), None, _min_length_dict, nullable=True,
                                       doc="InternEvo's tokenized folders: min_length per file whose path contains "
                                           "a key, e.g. {'cn/': 50}"),
                "text": Section(
                    {
                        "tokenizer": Key(STR, "byte", doc="'byte', a tokenizer.json, a SentencePiece .model, or a "
                                                          "folder holding one (prepare_data.py --tokenizer)"),
                        "eod_token": Key(STR, None, nullable=True,
                                         doc="end-of-document token; None: a SentencePiece model's EOS, guessed "
                                             "for a tokenizer.json (--eod-token)"),
                        "add_bos": Key(BOOL, False, doc="start each document with the SentencePiece model's BOS "
                                                        "(--add-bos)"),
                        "text_column": Key(STR, "text", doc="the JSON field / Parquet or datasets column holding "
                                                            "the text (--text-column)"),
                        "hf_split": Key(STR, "train", doc="the split of a DatasetDict folder (--hf-split)"),
                        "patterns": Key((list, tuple), None, _str_list, nullable=True,
                                        doc="file name patterns searched in folders; None: prepare_data.py's "
                                            "default (--pattern)"),
                        "valid_fraction": Key(FLOAT, 0.0, _below_one,
                                              doc="hold out this fraction of train_folder's documents for "
                                                  "validation, evenly spread (--valid-fraction)"),
                        "valid_every_nth": Key(INT, 0, _off_or_at_least_two,
                                               doc="hold out every Nth document (--valid-every-nth); 0: none"),
                        "workers": Key(INT, None, _positive, nullable=True,
                                       doc="tokenizer processes (rank 0's); None: every core (--workers). The "
                                           "token files are the same bytes whatever the number"),
                    },
                    doc="data.type='text': how raw files become tokens, with prepare_data.py's flags",
                ),
            }
        ),
        "adam": Section(
            {
                "lr": Key(FLOAT, 1e-4, _non_negative),
                "adam_beta1": Key(FLOAT, 0.9, _fraction),
                "adam_beta2": Key(FLOAT, 0.95, _fraction),
                "adam_eps": Key(FLOAT, 1e-8, _positive),
                "weight_decay": Key(FLOAT, 0.01, _non_negative),
                "decay_norm_and_bias": Key(BOOL, False, doc="False: norms and biases get no weight decay"),
            }
        ),
        "lr_scheduler": Section(
            {
                "total_steps": Key(INT, None, _positive, nullable=True, doc="None: data.total_steps"),
                "init_steps": Key(INT, 0, _non_negative),
                "warmup_ratio": Key(FLOAT, 0.01, _fraction),
                "eta_min": Key(FLOAT, 1e-5, _non_negative),
                "last_epoch": Key(INT, -1),
            }
        ),
        "grad_scaler": Section(
            {
                "fp16": Section(
                    {
                        "initial_scale": Key(FLOAT, 2**16, _positive),
                        "min_scale": Key(FLOAT, 1.0, _positive),
                        "growth_interval": Key(INT, 1000, _positive),
                    }
                ),
                "growth_factor": Key(FLOAT, 2.0, lambda v: None if v > 1 else "must be > 1"),
                "backoff_factor": Key(FLOAT, 0.5, lambda v: None if 0 < v < 1 else "must be in (0, 1)"),
                "max_scale": Key(FLOAT, 2**24, _positive),
                "hysteresis": Key(INT, 2, _positive),
            }
        ),
        "hybrid_zero_optimizer": Section(
            {
                "clip_grad_norm": Key(FLOAT, 1.0, _non_negative, doc="0 disables clipping"),
                "reduce_dtype": Key(STR, "fp32", _one_of("fp32", "model"),
                                    doc="dtype of gradient accumulation and the DP all-reduce"),
                "master_dtype": Key(STR, "fp32", _one_of("fp32", "bf16"),
                                    doc="bf16: masters share the bf16 weights' storage (model.dtype bf16 only)"),
                "master_compensation": Key(STR, "none", _one_of("none", "kahan", "stochastic"),
                                           doc="bf16 masters: a bf16 Kahan buffer, or unbiased stochastic rounding"),
                "optimizer_state_dtype": Key(STR, "fp32", _one_of("fp32", "bf16"),
                                             doc="storage of the Adam moments (the update computes in fp32)"),
                "overlap_sync_grad": Key(BOOL, True, doc="launch each gradient bucket's DP reduction during the "
                                                         "last micro-batch's backward"),
                "reduce_bucket_size": Key(INT, DEFAULT_REDUCE_BUCKET_SIZE, _positive,
                                          doc="elements per gradient bucket (the unit of DP reduction and overlap)"),
                "fuse_wgrad_accumulation": Key(BOOL, True,
                                               doc="the linears' backward adds weight gradients into the fp32 main "
                                                   "gradients inside the GEMM (fp32 output), where the device "
                                                   "offers one; False: a low-precision gradient added afterwards"),
                "max_consecutive_skips": Key(INT, 20, _positive,
                                             doc="stop the run when more steps than this in a row are skipped "
                                                 "(inf/NaN); fp16 counts them once the loss scale is at its minimum"),
            }
        ),
        "loss": Section({
            "label_smoothing": Key(FLOAT, 0.0, _fraction),
            "chunk_tokens": Key(INT, 1024, _non_negative,
                                doc="the head and the loss fused, this many tokens' logits at a time (fp32: chunk x "
                                    "vocab/tp x 4 bytes), made again in backward; 0: the whole logits, unfused"),
        }),
        "ckpt": Section(
            {
                "enable_save_ckpt": Key(BOOL, False),
                "save_ckpt_folder": Key(STR, None, nullable=True),
                "load_ckpt_folder": Key(STR, None, nullable=True, doc="weights-only start (fine-tuning)"),
                "auto_resume": Key(BOOL, True),
                "checkpoint_every": Key(INT, 0, _non_negative, doc="0: only at the end"),
                "keep_last": Key(INT, 0, _non_negative, doc="0: keep every checkpoint"),
            }
        ),
        "metrics": Section(
            {
                "log_every": Key(INT, 1, _positive,
                                 doc="print a line every N steps (metrics.jsonl and TensorBoard get every step)"),
                "tensorboard": Key(BOOL, True),
                "progress_bar": Key(BOOL, True),
                "peak_tflops": Key(FLOAT, None, _positive, nullable=True,
                                   doc="per-device peak for MFU; None: GPU table or measured CPU peak"),
                "precision_every": Key(INT, 0, _non_negative,
                                       doc="every N steps, measure per module where the low-precision formats "
                                           "lose information (gradient underflow/overflow/amax, update size and "
                                           "lost updates, activation amax, fp8 scales): metrics.jsonl kind "
                                           "'precision' and TensorBoard precision/<measure>/<module>; 0: off, "
                                           "nothing installed (tessera.train.precision_telemetry)"),
                "precision_group": Key(STR, "module", _one_of(*PRECISION_GROUPS),
                                       doc="what one row of the precision telemetry covers: 'module' (each "
                                           "module owning parameters, e.g. layers.0.attention.wq), 'layer' "
                                           "(layers.0, embedding, norm, output) or 'kind' (one module across "
                                           "layers, layers.*.attention.wq)"),
                "precision_activations": Key(BOOL, True,
                                             doc="the precision telemetry also hooks module outputs (activation "
                                                 "amax, fp8 input scales); False: gradients and updates only"),
                "wandb": Section(
                    {
                        "project": Key(STR, None, nullable=True,
                                       doc="Weights & Biases project: the scalars of TensorBoard and metrics.jsonl "
                                           "also go to W&B (rank 0, once a step) and the resolved config once; "
                                           "None: W&B off (extra 'wandb'; tessera.train.wandb_log)"),
                        "entity": Key(STR, None, nullable=True, doc="W&B team or user; None: the account's default"),
                        "mode": Key(STR, "online", _one_of("online", "offline", "disabled"),
                                    doc="offline: written under log_folder/job_name/wandb for `wandb sync`; "
                                        "disabled: W&B off"),
                        "name": Key(STR, None, nullable=True, doc="the W&B run's display name; None: job_name"),
                        "tags": Key((list, tuple), [], _str_list, doc="the W&B run's tags"),
                    }
                ),
            }
        ),
        "memory": Section(
            {
                "headroom": Key(FLOAT, DEFAULT_MEMORY_HEADROOM, _headroom,
                                doc="fraction of memory kept free for the CUDA context, kernels loaded on first "
                                    "use and allocator fragmentation: train.py's memory check refuses a run whose "
                                    "planned need exceeds (1 - headroom) x the free memory at launch; tools/plan.py "
                                    "fits within (1 - headroom) x the GPU's memory"),
            }
        ),
        "generate": Section(
            {
                "prompt": Key(STR, "def "),
                "max_new_tokens": Key(INT, 0, _non_negative, doc="sample this many tokens at the end (0: none)"),
                "temperature": Key(FLOAT, 0.8, _non_negative),
                "top_k": Key(INT, 0, _non_negative),
                "top_p": Key(FLOAT, 1.0, _fraction),
            }
        ),
        "eval": Section(
            {
                "tasks": Key((list, tuple), [], _str_list,
                             doc="lm-evaluation-harness task (or group) names run on the live model during and "
                                 "after training, e.g. ['hellaswag']; []: off. Needs the extra 'eval' (lm-eval); "
                                 "every name is checked before the first step (tessera.train.live_eval, "
                                 "docs/evaluation.md)"),
                "every": Key(INT, 0, _non_negative, doc="evaluate every N steps; 0: only at the end"),
                "at_end": Key(BOOL, True, doc="evaluate after the last step (once, after the final checkpoint)"),
                "include_path": Key(STR, None, nullable=True,
                                    doc="a folder of extra lm-eval task YAML files (local tasks)"),
                "limit": Key(INT, None, _positive, nullable=True,
                             doc="at most this many documents per task; None: every document"),
                "num_fewshot": Key(INT, None, _non_negative, nullable=True,
                                   doc="examples before each question; None: the task's own default"),
                "batch_size": Key(INT, 16, _positive, doc="rows per forward when scoring"),
                "max_length": Key(INT, None, _positive, nullable=True,
                                  doc="positions per forward; None: model.max_position_embeddings (capped by "
                                      "model.sliding_window)"),
                "max_gen_toks": Key(INT, 256, _positive, doc="tokens generated when a task names no limit"),
                "seed": Key(INT, 0, _eval_seed, doc="lm-eval's seeds (sampling, few-shot draws); the training "
                                                    "RNG streams are saved before and restored after"),
                "dtype": Key(STR, "fp32", _one_of("fp32", "bf16", "fp16"),
                             doc="the evaluated copy's dtype (the fp32 masters cast): its memory on rank 0 is "
                                 "parameters x 4 bytes in fp32, x 2 in bf16/fp16"),
                "tokenizer": Key(STR, None, nullable=True,
                                 doc="'byte', a tokenizer.json or a SentencePiece .model; None: the run's "
                                     "(as tools/evaluate.py finds it for a checkpoint of this run)"),
                "timeout_s": Key(FLOAT, 3600.0, _positive,
                                 doc="how long the other ranks wait for rank 0's evaluation; past it every rank "
                                     "stops with an error"),
            }
        ),
    },
    optional=False,
)


def default_of(path: str) -> Any:
    """The schema's default of a dotted key (``"model.dtype"``): the one place each default is written."""
    node: Key | Section = SCHEMA
    for part in path.split("."):
        if not isinstance(node, Section):
            raise KeyError(path)
        node = node.keys[part]
    if not isinstance(node, Key):
        raise KeyError(f"{path} is a section, not a key")
    return node.default
