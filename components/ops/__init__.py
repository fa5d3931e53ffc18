"""Operations: deployments, work pools and static checks of the production files (infra/, dashboards/)."""
