#!/usr/bin/env python3
"""Validates rendered Kubernetes manifests against real schemas.

Usage: validate.py [--k8s VERSION] [--json OUT] FILE.yaml...   (multi-document YAML)

Every object is checked by exactly one validator, chosen by its apiVersion:
  * Kubernetes core and built-in API groups: kubernetes-validate (PyPI), the
    API server's published OpenAPI schemas for --k8s (default 1.33), in
    strict mode (unknown fields are errors);
  * Gateway API, Envoy Gateway, Istio, Prometheus Operator: the schemas
    generated from those projects' CRDs (npm @kubernetes-models/*), run by
    validate-crds.mjs with node;
  * InferencePool (Gateway API Inference Extension): schemas/inferencepool-v1.json
    with jsonschema.
An object no validator knows is an error, so nothing passes unchecked.
Prints one line per object and a summary; exits 1 if any object fails.
Environment: KVGATE_NPM (folder with node_modules and validate-crds.mjs).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

import jsonschema
import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).resolve().parent
CRD_GROUPS = {
    "gateway.networking.k8s.io", "gateway.envoyproxy.io", "networking.istio.io",
    "extensions.istio.io", "security.istio.io", "monitoring.coreos.com",
}
LOCAL_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json"}


def ident(obj):
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k8s", default="1.33.0")
    ap.add_argument("--json", help="also write every object, as a JSON array, to this file")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()

    objs = []
    for f in args.files:
        with open(f) as fh:
            for doc in yaml.safe_load_all(fh):
                if doc is not None:
                    objs.append((f, doc))

    if args.json:
        with open(args.json, "w") as fh:
            json.dump([o for _, o in objs], fh)

    results = {}  # index -> (validator, error or None)
    crd = []
    for i, (_, obj) in enumerate(objs):
        api = str(obj.get("apiVersion", ""))
        group = api.split("/")[0] if "/" in api else ""
        local = LOCAL_SCHEMAS.get((api, obj.get("kind")))
        if local:
            schema = json.loads((HERE / "schemas" / local).read_text())
            errs = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
            msg = "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errs) or None
            results[i] = ("jsonschema", msg)
        elif group in CRD_GROUPS:
            crd.append(i)
        else:
            try:
                kubernetes_validate.validate(obj, args.k8s, strict=True)
                results[i] = ("kubernetes-validate", None)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(map(str, e.path))
                results[i] = ("kubernetes-validate", f"{path}: {e.message}")
            except Exception as e:  # SchemaNotFoundError and the like
                results[i] = ("kubernetes-validate", f"{type(e).__name__}: {e}")

    if crd:
        npm = pathlib.Path(os.environ.get("KVGATE_NPM", HERE.parent.parent / ".tools" / "npm"))
        payload = json.dumps([objs[i][1] for i in crd])
        p = subprocess.run(["node", str(npm / "validate-crds.mjs")], input=payload, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"validate-crds.mjs failed: {p.stderr}", file=sys.stderr)
            return 2
        for i, err in zip(crd, json.loads(p.stdout)):
            results[i] = ("kubernetes-models", err)

    failed = 0
    by_validator = {}
    for i, (f, obj) in enumerate(objs):
        validator, err = results[i]
        by_validator[validator] = by_validator.get(validator, 0) + 1
        if err:
            failed += 1
            print(f"FAIL {f}: {ident(obj)} ({validator}): {err}")
        else:
            print(f"ok   {f}: {ident(obj)} ({validator})")
    summary = ", ".join(f"{n} by {v}" for v, n in sorted(by_validator.items()))
    print(f"{len(objs)} objects, {failed} failed ({summary})")
    return 1 if failed or not objs else 0


if __name__ == "__main__":
    sys.exit(main())
