//! Issue #9: every Kubernetes manifest renders and validates against real
//! schemas, and the configurations inside them are accepted by the parts
//! that read them.
//!
//! * Every kustomization under `deploy/` and `gateway-api/` renders with
//!   Debian's kubectl 1.20 (kustomize v2.0.3) and, when the machine has one,
//!   with the system's newer kubectl, to the same objects.
//! * `deploy/validate/validate.py` checks each rendered object with the
//!   Kubernetes OpenAPI schemas (strict), the Gateway API / Envoy Gateway /
//!   Istio / Prometheus Operator CRD schemas, or the InferencePool schema;
//!   a manifest broken on purpose is refused.
//! * The kvgate filter configuration in the Envoy Gateway and Istio
//!   resources parses with the filter's own parser and names the cluster
//!   those resources create; the control-plane ConfigMaps validate with
//!   the control plane's own configuration code; the Envoy pieces the
//!   gateway resources patch in (the control-plane cluster, the Wasm filter
//!   with allow_on_headers_stop_iteration, the override-host cluster) pass
//!   `envoy --mode validate` of Envoy 1.40.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvgate_testkit::{envoy_validate, filter_wasm, repo_root, scratch_dir, tool};
use serde_json::{Value, json};

/// Every folder with a kustomization.yaml under deploy/ and gateway-api/.
fn kustomizations() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                if p.join("kustomization.yaml").is_file() {
                    out.push(p.clone());
                }
                walk(&p, out);
            }
        }
    }
    let mut out = Vec::new();
    for top in ["deploy", "gateway-api"] {
        walk(&repo_root().join(top), &mut out);
    }
    out
}

fn render(kubectl: &Path, dir: &Path) -> String {
    let out = Command::new(kubectl).arg("kustomize").arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "{} kustomize {} failed: {}",
        kubectl.display(),
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// (kind, metadata.name) of every document of kustomize's output, whose
/// top-level keys are sorted and indented by two.
fn identities(yaml: &str) -> BTreeSet<(String, String)> {
    let mut ids = BTreeSet::new();
    for doc in yaml.split("\n---\n") {
        let mut kind = None;
        let mut name = None;
        let mut in_meta = false;
        for line in doc.lines() {
            if !line.starts_with(' ') {
                in_meta = line == "metadata:";
                if let Some(k) = line.strip_prefix("kind: ") {
                    kind = Some(k.to_owned());
                }
            } else if in_meta && let Some(n) = line.strip_prefix("  name: ") {
                name = Some(n.to_owned());
            }
        }
        if let (Some(k), Some(n)) = (kind, name) {
            // Generated ConfigMaps and Secrets carry a content hash that
            // differs between kustomize versions (key order); drop it.
            let n = if k == "ConfigMap" || k == "Secret" {
                n.rsplit_once('-').map_or(n.clone(), |(b, _)| b.to_owned())
            } else {
                n
            };
            ids.insert((k, n));
        }
    }
    ids
}

fn python() -> PathBuf {
    tool("KVGATE_PYTHON", "python3").unwrap()
}

/// Runs validate.py on `files`; returns (success, stdout).
fn validate(files: &[PathBuf], json_out: Option<&Path>) -> (bool, String) {
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("deploy/validate/validate.py"));
    if let Some(j) = json_out {
        cmd.arg("--json").arg(j);
    }
    let out = cmd.args(files).output().unwrap();
    assert!(out.status.code().is_some_and(|c| c <= 1), "validate.py crashed: {}", String::from_utf8_lossy(&out.stderr));
    (out.status.success(), String::from_utf8(out.stdout).unwrap())
}

/// Renders everything once (Debian's kubectl) into the scratch folder.
fn render_all(dir: &Path) -> Vec<PathBuf> {
    let debian = tool("KVGATE_KUBECTL_DEBIAN", "kubectl-debian").unwrap();
    let system = std::env::var_os("KVGATE_KUBECTL").filter(|s| !s.is_empty()).map(PathBuf::from);
    let mut files = Vec::new();
    for k in kustomizations() {
        let rendered = render(&debian, &k);
        if let Some(sys) = &system {
            let newer = render(sys, &k);
            assert_eq!(
                identities(&rendered),
                identities(&newer),
                "{}: the two kustomize versions disagree",
                k.display()
            );
        }
        assert!(!identities(&rendered).is_empty(), "{} renders nothing", k.display());
        let rel = k.strip_prefix(repo_root()).unwrap().to_string_lossy().replace('/', "_");
        let f = dir.join(format!("{rel}.yaml"));
        std::fs::write(&f, rendered).unwrap();
        files.push(f);
    }
    files
}

#[test]
fn every_kustomization_renders_with_both_kubectls_and_validates() {
    let dir = scratch_dir("manifests-valid").unwrap();
    let dirs = kustomizations();
    let names: Vec<String> =
        dirs.iter().map(|d| d.strip_prefix(repo_root()).unwrap().to_string_lossy().into_owned()).collect();
    for want in [
        "deploy/overlays/dev",
        "deploy/overlays/production",
        "deploy/overlays/production-mtls",
        "gateway-api/envoy-gateway",
        "gateway-api/envoy-gateway-mtls",
        "gateway-api/istio",
        "gateway-api/inference-extension",
    ] {
        assert!(names.iter().any(|n| n == want), "missing kustomization {want} in {names:?}");
    }
    let files = render_all(&dir);
    let (ok, out) = validate(&files, None);
    assert!(
        ok,
        "manifests do not validate:\n{}",
        out.lines().filter(|l| !l.starts_with("ok")).collect::<Vec<_>>().join("\n")
    );
    let summary = out.lines().last().unwrap_or_default();
    for v in ["kubernetes-validate", "kubernetes-models", "jsonschema"] {
        assert!(summary.contains(&format!("by {v}")), "no object was checked by {v}: {summary}");
    }
    println!("{summary}");
}

#[test]
fn a_broken_manifest_is_refused_by_each_validator() {
    let dir = scratch_dir("manifests-broken").unwrap();
    let debian = tool("KVGATE_KUBECTL_DEBIAN", "kubectl-debian").unwrap();
    let root = repo_root();
    let dev = render(&debian, &root.join("deploy/overlays/dev"));
    let eg = render(&debian, &root.join("gateway-api/envoy-gateway"));
    let pool = render(&debian, &root.join("gateway-api/inference-extension"));
    let cases = [
        ("Deployment/kvgate-control-plane", dev.replacen("  replicas: 2\n", "  replica: 2\n", 1)),
        ("BackendTrafficPolicy/kvgate-workers", eg.replacen("type: LeastRequest", "type: Fastest", 1)),
        ("InferencePool/vllm-llama-70b", pool.replacen("failureMode: FailOpen", "failureMode: Open", 1)),
        ("HTTPRoute/openai", eg.replacen("port: 8000", "port: eight-thousand", 1)),
    ];
    for (i, (object, text)) in cases.iter().enumerate() {
        let f = dir.join(format!("broken-{i}.yaml"));
        std::fs::write(&f, text).unwrap();
        let (ok, out) = validate(&[f], None);
        assert!(!ok, "{object}: the broken manifest was accepted");
        assert!(
            out.lines().any(|l| l.starts_with("FAIL") && l.contains(object)),
            "{object} not named as failing:\n{out}"
        );
    }
}

fn objects(dir: &Path) -> Vec<Value> {
    let files = render_all(dir);
    let j = dir.join("objects.json");
    let (ok, out) = validate(&files, Some(&j));
    assert!(ok, "{out}");
    serde_json::from_slice::<Value>(&std::fs::read(&j).unwrap()).unwrap().as_array().unwrap().clone()
}

/// A YAML text as JSON (PyYAML, as validate.py reads manifests).
fn yaml_to_json(text: &str) -> Value {
    use std::io::Write;
    let mut child = Command::new(python())
        .args(["-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn find<'a>(objs: &'a [Value], kind: &str, name_prefix: &str) -> Vec<&'a Value> {
    objs.iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"].as_str().is_some_and(|n| n.starts_with(name_prefix)))
        .collect()
}

#[test]
fn configurations_inside_the_manifests_are_accepted_by_their_readers() {
    let dir = scratch_dir("manifests-configs").unwrap();
    let objs = objects(&dir);

    // Envoy Gateway: the filter config parses and calls the cluster the
    // EnvoyPatchPolicy adds; the patch turns on header pausing.
    let eep = find(&objs, "EnvoyExtensionPolicy", "kvgate")[0];
    let eg_filter = &eep["spec"]["wasm"][0]["config"];
    let cfg = kvgate_filter_core::config::Config::parse(eg_filter.to_string().as_bytes()).unwrap();
    let epp = find(&objs, "EnvoyPatchPolicy", "kvgate")[0];
    let patches = epp["spec"]["jsonPatches"].as_array().unwrap();
    let cluster = patches.iter().find(|p| p["type"].as_str().unwrap().ends_with("Cluster")).unwrap();
    assert_eq!(cluster["name"].as_str(), Some(cfg.cluster.as_str()));
    assert!(patches.iter().any(|p| p["operation"]["path"] == "/typed_config/config/allow_on_headers_stop_iteration"
        && p["operation"]["value"] == true));

    // Mutual TLS (envoy-gateway-mtls): the control-plane cluster's
    // transport socket is envoy/control-plane-tls.yaml, which the gateway
    // tests run in a real Envoy against `kvgate serve`, with the files of
    // the Secret the EnvoyProxy mounts.
    let tls_epp = find(&objs, "EnvoyPatchPolicy", "kvgate")
        .into_iter()
        .find(|p| !p["spec"]["jsonPatches"][0]["operation"]["value"]["transport_socket"].is_null())
        .expect("an EnvoyPatchPolicy with mutual TLS");
    let socket = &tls_epp["spec"]["jsonPatches"][0]["operation"]["value"]["transport_socket"];
    let mount = "/etc/kvgate-tls";
    let (ca, crt, key) = (format!("{mount}/ca.crt"), format!("{mount}/tls.crt"), format!("{mount}/tls.key"));
    let fragment = kvgate_testkit::render_template(
        &std::fs::read_to_string(repo_root().join("envoy/control-plane-tls.yaml")).unwrap(),
        &std::collections::BTreeMap::from([
            ("CA_FILE", ca),
            ("CERT_FILE", crt),
            ("KEY_FILE", key),
            ("SNI", "kvgate-control-plane.kvgate.svc".to_owned()),
        ]),
    )
    .unwrap();
    assert_eq!(socket, &yaml_to_json(&fragment)["transport_socket"], "EG's transport socket is not the tested one");
    let proxy = find(&objs, "EnvoyProxy", "kvgate-mtls")[0];
    let eg_pod = &proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"];
    assert_eq!(eg_pod["container"]["volumeMounts"][0]["mountPath"], mount);
    assert_eq!(eg_pod["pod"]["volumes"][0]["secret"]["secretName"], "kvgate-gateway-tls");
    let gateways = find(&objs, "Gateway", "kvgate");
    assert!(gateways.iter().any(|g| g["spec"]["infrastructure"]["parametersRef"]["name"] == "kvgate-mtls"));
    // production-mtls: the control plane reads its TLS files from the
    // mounted Secret, and is probed over HTTP (a gRPC probe cannot do TLS).
    let cp = find(&objs, "Deployment", "kvgate-control-plane")
        .into_iter()
        .find(|d| d["spec"]["template"]["spec"]["containers"][0]["env"].to_string().contains("KVGATE_TLS_CERT_FILE"))
        .expect("a control plane with TLS");
    let pod = &cp["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let tls_mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "tls").unwrap();
    let tls_dir = tls_mount["mountPath"].as_str().unwrap();
    for e in c["env"].as_array().unwrap().iter().filter(|e| e["name"].as_str().unwrap().starts_with("KVGATE_TLS_")) {
        assert!(e["value"].as_str().unwrap().starts_with(&format!("{tls_dir}/")), "{e}");
    }
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["name"] == "tls" || !tls_dir.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap()))),
        "TLS mounted inside another volume"
    );
    assert!(pod["volumes"].as_array().unwrap().iter().any(|v| v["secret"]["secretName"] == "kvgate-control-plane-tls"));
    assert!(c["livenessProbe"]["grpc"].is_null() && c["livenessProbe"]["httpGet"]["path"] == "/healthz");

    // Inference Extension: the pool's endpoint picker is the control
    // plane's gRPC port (where `kvgate serve` serves ext_proc), over h2c,
    // and the pool selects the vLLM pods.
    let pool = find(&objs, "InferencePool", "vllm")[0];
    let picker = &pool["spec"]["endpointPickerRef"];
    let svc = find(&objs, "Service", picker["name"].as_str().unwrap())
        .into_iter()
        .find(|s| s["metadata"]["name"] == picker["name"])
        .expect("the picker's Service");
    let port = svc["spec"]["ports"].as_array().unwrap().iter().find(|p| p["port"] == picker["port"]["number"]).unwrap();
    assert_eq!((port["name"].as_str(), port["appProtocol"].as_str()), (Some("grpc"), Some("kubernetes.io/h2c")));
    let vllm = find(&objs, "Deployment", "vllm")[0];
    let labels = &vllm["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the pool does not select the vLLM pods");
    }

    // Istio: the ECDS Wasm config parses and calls Istio's cluster for the
    // control plane's Service.
    let ef = find(&objs, "EnvoyFilter", "kvgate-wasm-config")[0];
    let wasm = &ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"];
    let istio_cfg_text = wasm["config"]["configuration"]["value"].as_str().unwrap();
    let istio_cfg = kvgate_filter_core::config::Config::parse(istio_cfg_text.as_bytes()).unwrap();
    assert_eq!(istio_cfg.cluster, "outbound|50051||kvgate-control-plane.kvgate.svc.cluster.local");
    assert_eq!(wasm["config"]["allow_on_headers_stop_iteration"], true);

    // The control plane's configuration files (dev and production) validate;
    // the tokenizer folder is pointed at the test tokenizer.
    let tk = tool("KVGATE_TOKENIZER_DIR", "deepseek-v3").unwrap();
    let cms = find(&objs, "ConfigMap", "kvgate-control-plane");
    assert!(cms.len() >= 2, "expected the dev and production ConfigMaps");
    for cm in cms {
        let text = cm["data"]["kvgate.toml"].as_str().unwrap();
        let text: String = text
            .lines()
            .map(|l| {
                if l.starts_with("tokenizer_dir") {
                    format!("tokenizer_dir = {:?}", tk.display().to_string())
                } else {
                    l.into()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        let raw = kvgate_server::RawConfig::from_toml(&text, "ConfigMap").unwrap();
        kvgate_server::Config::validate(raw).unwrap();
    }

    // Envoy 1.40 accepts what the gateway resources patch in: the
    // control-plane cluster (EG), the Wasm filter config with its flags
    // (Istio, with the module from a local file), and the workers' cluster
    // with the override-host policy merged in (Istio).
    let mut cp_cluster = cluster["operation"]["value"].clone();
    cp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"] =
        json!("127.0.0.1");
    let ov = find(&objs, "EnvoyFilter", "kvgate-override-host")[0];
    let merge = &ov["spec"]["configPatches"][0]["patch"]["value"];
    let mut workers = json!({
        "name": "workers", "type": "STATIC", "connect_timeout": "1s", "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}
    });
    for (k, v) in merge.as_object().unwrap() {
        workers[k] = v.clone();
    }
    let mut wasm_cfg = wasm.clone();
    wasm_cfg["config"]["vm_config"]["code"] = json!({"local": {"filename": filter_wasm().unwrap()}});
    let listener_merge =
        &find(&objs, "EnvoyFilter", "kvgate-wasm-filter")[0]["spec"]["configPatches"][1]["patch"]["value"];
    let mut listener = json!({
        "name": "openai",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "openai",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "workers"}}]}]},
            "http_filters": [
                {"name": "kvgate", "typed_config": wasm_cfg},
                {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]
    });
    for (k, v) in listener_merge.as_object().unwrap() {
        listener[k] = v.clone();
    }
    // The cluster of the filter's own prefill legs, by the name the
    // filter's configuration defaults to; Istio adds the same one.
    let prefill = patches
        .iter()
        .find(|p| p["name"] == cfg.disaggregation.cluster.as_str())
        .expect("EG's patch adds the filter's prefill cluster");
    let prefill = prefill["operation"]["value"].clone();
    let istio_prefill = ov["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["patch"]["operation"] == "ADD")
        .expect("Istio's EnvoyFilter adds the prefill cluster");
    assert_eq!(istio_prefill["patch"]["value"], prefill);
    assert_eq!(istio_cfg.disaggregation.cluster, cfg.disaggregation.cluster);
    let bootstrap = json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"listeners": [listener], "clusters": [cp_cluster, workers, prefill]}
    });
    let f = dir.join("gateway-pieces.json");
    std::fs::write(&f, serde_json::to_vec_pretty(&bootstrap).unwrap()).unwrap();
    envoy_validate(&f).unwrap();
}
