"""The conformance kit: a pytest plugin a vendor runs against its backend.

    pytest --pyargs mtcore.testing.conformance --mtcore-backend NAME

checks the four contracts of ``mtcore.backend``, and the health of the
installed plugins, on backend NAME (default:
``MTCORE_BACKEND``, else automatic selection):

* device: placement, synchronize, streams and events, memory stats, RNG,
  autocast, capabilities (``test_device.py``);
* collective: every operation on 2 and 4 ranks, with exact expected values,
  FP8 through its fallback, async handles, subgroups (``test_collective.py``;
  the checks are ``mtcore.backend.checks.collective_checks``); skipped when the backend sees fewer devices than
  ranks;
* kernel: every implementation the kernel table can select, forward and
  backward, against the reference ops of ``mtcore.ops`` with stated
  tolerances, and bfloat16 results free of systematic bias
  (``test_kernels.py``; the cases are
  ``mtcore.backend.checks.kernel_cases``, which `mtcore train`'s self-check shares);
* fp8: quantize/dequantize round trip per granularity, scaled matmul per
  granularity pair (each granularity with itself, blockwise 1x128 x 128x128,
  and every pair the backend declares native), with the path (native or
  fallback) each takes (``test_fp8.py``);
* plugins: no installed mtcore plugin is broken once the backend is built
  (``test_plugins.py``).

``--mtcore-area AREA`` (repeatable, or comma-separated) runs only the areas
named: device, collective, kernel (or kernels), fp8, plugins.

A summary titled "mtcore conformance: backend NAME" ends the run: passed,
failed and skipped counts per area, and the reasons for skips. A skip whose
reason starts with "capability:" is a capability the backend declares it
lacks, not a failure.

The ``--mtcore-backend`` option comes from ``mtcore.testing.conformance.plugin``,
which the ``pytest11`` entry point of the mtcore distribution loads. With
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` add ``-p mtcore.testing.conformance.plugin``
(or set ``MTCORE_BACKEND`` and leave the option out).
"""
