from setuptools import find_packages, setup

setup(
    name="megatron-cascade",
    version="0.1.0",
    description="Cascade RL and multi-domain on-policy distillation (MOPD) for Megatron-Core",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_cascade", "megatron_cascade.*"]),
    package_data={"megatron_cascade": ["py.typed"]},
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "omegaconf>=2.3",
        "tensorboard>=2.15",
        "math-verify>=0.7",
        "jsonschema>=4.0",
        "safetensors>=0.4",
        "psutil>=5.9",
        "tqdm>=4.0",
        "matplotlib>=3.7",
        "numpy",
        "einops>=0.7",  # megatron-core's Mamba mixer (hybrid models)
        "xxhash>=3.0",  # checkpoint file records: every byte hashed at page-cache speed
    ],
    extras_require={
        # triton: what PyPI's (CUDA) torch wheel brings along. With it importable, megatron-core takes
        # Triton paths on any device; the suite runs with it so that CPU mode is tested against them.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "transformers>=4.45",
                 "triton>=3.4; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        # megatron-core 0.16.1's own supported range (its "dev" extra). NVIDIA apex is not on PyPI
        # (the PyPI "apex" is an unrelated package): build it from github.com/NVIDIA/apex if wanted.
        # flash-attn: the paged KV-cache kernels generation runs on GPU (megatron-core's dynamic
        # inference path asserts flash-attn >= 2.7.3 or FA3); it builds against the local CUDA toolkit.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "flash-attn>=2.7.3"],
        # The Mamba layers' CUDA kernels (hybrid models, Nemotron-3-Nano): megatron-core 0.16.1's dev
        # extra's ranges. Both are CUDA source builds: pip install --no-build-isolation (scripts/install_gpu.sh).
        "hybrid": ["mamba-ssm>=2.2,<2.4", "causal-conv1d>=1.5.3"],
    },
    entry_points={"console_scripts": ["megatron-cascade=megatron_cascade.cli:main"]},
)
