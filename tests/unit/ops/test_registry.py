"""The op table and signatures are a contract with plugin kernels."""

import ast
import inspect
import sys
from pathlib import Path

import torch

import mtcore.ops as ops

EXPECTED_PARAMS = {
    "rms_norm": ["x", "weight", "eps"],
    "layer_norm": ["x", "weight", "bias", "eps"],
    "rope": ["x", "cos", "sin"],
    "swiglu": ["x"],
    "attention": [
        "q",
        "k",
        "v",
        "causal",
        "key_padding_mask",
        "scale",
        "window",
        "dropout_p",
        "dropout_seeds",
        "query_documents",
        "key_documents",
    ],
    "attention_lse": [
        "q", "k", "v", "causal", "key_padding_mask", "scale", "window", "query_documents",
        "key_documents",
    ],
    "cross_entropy": ["logits", "target", "ignore_index"],
    "adamw_step": [
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "step",
        "lr",
        "beta1",
        "beta2",
        "eps",
        "weight_decay",
    ],
    "grouped_mm": ["x", "weight", "tokens_per_expert"],
    "fp8_quantize": ["x", "dtype", "granularity", "scale"],
    "fp8_quantize_transpose": ["x", "dtype", "granularity", "scale"],
    "fp8_dequantize": ["data", "scale_inv", "granularity", "out_dtype"],
}
OPS_DIR = Path(ops.__file__).parent


def test_reference_ops_table_is_exactly_the_contract_ops():
    assert set(ops.REFERENCE_OPS) == set(EXPECTED_PARAMS)
    for name, fn in ops.REFERENCE_OPS.items():
        assert fn is getattr(ops, name)


def test_signatures_match_contract():
    for name, params in EXPECTED_PARAMS.items():
        assert list(inspect.signature(ops.REFERENCE_OPS[name]).parameters) == params, name
    adam = inspect.signature(ops.adamw_step).parameters
    assert all(adam[p].kind is inspect.Parameter.KEYWORD_ONLY for p in params[4:])
    assert inspect.signature(ops.rms_norm).parameters["eps"].default == 1e-6
    assert inspect.signature(ops.layer_norm).parameters["eps"].default == 1e-5
    assert inspect.signature(ops.cross_entropy).parameters["ignore_index"].default == -100


def test_helpers_exported():
    assert ops.GRANULARITIES == ("tensor", "row", "1x128", "128x128")
    assert dict(ops.FP8_MAX) == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
    assert callable(ops.rope_tables) and callable(ops.fp8_dequantize)


def test_ops_import_only_torch_and_stdlib():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in OPS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
                if node.module.startswith("mtcore"):
                    assert node.module.startswith("mtcore.ops"), (path.name, node.module)
                    continue
            else:
                continue
            for root in roots:
                assert root == "torch" or root in stdlib, (path.name, root)
