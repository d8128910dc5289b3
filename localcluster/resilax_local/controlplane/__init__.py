"""The control plane of a local cluster: the upstream etcd, kube-apiserver, kube-controller-manager and
kube-scheduler as local processes (`plane.py`), their certificates (`pki.py`), the audit log's reader
(`audit.py`), the RBAC an operator run outside the chart gets (`rbac.py`), and Kueue, the optional
add-on (`kueue.py`, with the manifests it applies: `kueue_manifests.py`)."""
