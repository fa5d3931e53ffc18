"""The reliability suite (`make test-reliability`): whole `sao` processes killed and resumed, with the store in S3
(moto's server) and MLflow on sqlite. The training fixtures (the tiny SFT policy, seeded homes) are shared."""

from tests.training.conftest import seeded_home, sft_dir  # noqa: F401  (fixtures)
