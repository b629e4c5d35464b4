"""margrpo_jax: MAR-GRPO (stabilised GRPO for masked-autoregressive image generators) in JAX/Flax."""
from setuptools import find_packages, setup

with open("requirements.txt") as f:
  requirements = [l.strip() for l in f if l.strip() and not l.startswith("#")]

setup(
    name="margrpo_jax",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["margrpo_jax", "margrpo_jax.*"]),
    package_data={"margrpo_jax": ["assets/**/*", "assets/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    license="MIT",
    install_requires=requirements,
)
