"""The checkpoint sidecar that runs in every worker pod."""
