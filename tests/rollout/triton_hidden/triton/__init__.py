# First on PYTHONPATH, this hides an installed triton (tests/rollout/test_triton_paths.py): a machine with
# PyTorch's CPU wheel, which brings no triton.
raise ImportError("triton is hidden from this test run (tests/rollout/triton_hidden)")
