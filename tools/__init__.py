"""Operations tools run from a checkout (`python -m tools.X`): deployments and work pools (`make deploy`) and the
static checks of infra/ and dashboards/ (`make infra-check`). They are not part of the importable library."""
