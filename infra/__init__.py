"""How capline meets a cluster (Ray cluster / KubeRay manifests, MLflow server, images, schedules)."""
