"""Installable form of the project: the `seq1f1b` package and the `megatron.training` namespace
portion (which merges with megatron-core's `megatron` namespace; there is no megatron/__init__.py).
"""
from setuptools import find_namespace_packages, setup

setup(
    name="seq1f1b-megatron",
    version="0.1.0",
    description="Seq1F1B sequence-level pipeline parallelism on megatron-core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["seq1f1b", "seq1f1b.*", "megatron.training",
                                              "megatron.training.*"]),
    package_data={"megatron.training": ["megatron_lm_flags.tsv"]},   # Megatron-LM's flag list
    install_requires=["torch==2.13.0", "megatron-core==0.16.1", "numpy", "matplotlib"],
)
