"""Shared pytest set-up. Each area's fixtures live in its own conftest under tests/<area>/."""

# The local cluster's fixtures (local_cluster, cluster, kube, namespace, fake_gcs, gcs_bucket) for every area.
pytest_plugins = ["resilax_local.pytest_plugin"]
