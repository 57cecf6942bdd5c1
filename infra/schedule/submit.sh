#!/bin/sh
# Entry point of the scheduled-run launcher (the Cloud Run job that the workflow runs):
# `promptmill ARGS...`, after fetching kubectl credentials for the GKE cluster named by
# GKE_CLUSTER (and GKE_LOCATION, its region or zone) when that is set, because
# `promptmill submit gke` creates its JobSet in that cluster.
set -eu

if [ -n "${GKE_CLUSTER:-}" ]; then
    if [ -z "${GKE_LOCATION:-}" ]; then
        echo "promptmill-submit: GKE_CLUSTER=$GKE_CLUSTER is set but GKE_LOCATION is not: set it to the cluster's region or zone (gcloud run jobs update JOB --update-env-vars=GKE_LOCATION=REGION)" >&2
        exit 2
    fi
    gcloud container clusters get-credentials "$GKE_CLUSTER" --location "$GKE_LOCATION" \
        ${GKE_PROJECT:+--project "$GKE_PROJECT"}
fi

exec promptmill "$@"
