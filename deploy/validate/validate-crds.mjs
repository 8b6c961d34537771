// Validates custom resources against the schemas published as the
// @kubernetes-models packages (generated from the projects' CRDs).
// Input: a JSON array of objects on stdin. Output: a JSON array, one entry
// per object: null when valid, else the error text; exit 0 either way (the
// caller decides), 2 on a usage error.
// The packages are ES modules resolved from this file's folder, so
// scripts/setup.sh installs them, and a copy of this file, into .tools/npm.

// group/version -> package prefix
const groups = {
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api/gateway.networking.k8s.io",
  "gateway.envoyproxy.io": "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io",
  "networking.istio.io": "@kubernetes-models/istio/networking.istio.io",
  "extensions.istio.io": "@kubernetes-models/istio/extensions.istio.io",
  "security.istio.io": "@kubernetes-models/istio/security.istio.io",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator/monitoring.coreos.com",
};

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (c) => (input += c));
process.stdin.on("end", async () => {
  let objs;
  try {
    objs = JSON.parse(input);
  } catch (e) {
    console.error(`validate-crds: stdin is not JSON: ${e.message}`);
    process.exit(2);
  }
  const out = [];
  for (const obj of objs) out.push(await check(obj));
  process.stdout.write(JSON.stringify(out));
});

async function check(obj) {
  {
    const [group, version] = String(obj.apiVersion || "").split("/");
    const base = groups[group];
    if (!base || !version) return `no published schema for apiVersion ${obj.apiVersion}`;
    let Model;
    try {
      Model = (await import(`${base}/${version}/${obj.kind}`))[obj.kind];
    } catch (e) {
      return `no published schema for ${obj.apiVersion} ${obj.kind}`;
    }
    if (typeof Model !== "function") return `no model class for ${obj.apiVersion} ${obj.kind}`;
    try {
      new Model(obj).validate();
      return null;
    } catch (e) {
      return String(e.message || e);
    }
  }
}
