//! The deployment files made from `envoy/` (`make deploy-manifests`, also run
//! by `make image`): so the Kubernetes objects and the remote-code Envoy
//! config never drift from what the tests load. `tests/tests/deploy.rs`
//! checks that the committed files are exactly what this renders.
//!
//! Inputs: `envoy/sluice.yaml` (the policy, the `stats_tags`, the filter
//! block), `envoy/prometheus-rules.yaml`, `envoy/grafana-dashboard.json` and
//! `deploy/release.env` (the image references and digests that `make image`
//! wrote). Output: `(path relative to the repository, text)` pairs.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{anyhow, bail, Context as _};
use serde_yaml::{Mapping, Value};

use crate::EnvoyConfig;

/// The Kubernetes namespace the manifests use (kustomize `namespace:`).
pub const NAMESPACE: &str = "sluice";
/// The sidecar's Service, and so its DNS name in the mesh.
pub const SIDECAR_SERVICE: &str = "sluice-sidecar";
/// The sidecar's port.
pub const SIDECAR_PORT: u16 = 9911;

/// Gateway replicas of the fleet overlay (`fleet.expected_replicas`).
pub const FLEET_REPLICAS: u64 = 3;
/// What the fleet overlay ships as `fleet.salt`: replace it.
pub const FLEET_SALT_PLACEHOLDER: &str = "replace-me-openssl-rand-hex-16";

/// The sidecar's in-cluster DNS name.
pub fn sidecar_host() -> String {
    format!("{SIDECAR_SERVICE}.{NAMESPACE}.svc.cluster.local")
}

/// The name Istio gives the cluster of a Service port, which the filter's
/// `sidecar.cluster` must name under Istio (`outbound|PORT|SUBSET|HOST`).
pub fn istio_sidecar_cluster() -> String {
    format!("outbound|{SIDECAR_PORT}||{}", sidecar_host())
}

/// `deploy/release.env`: what the manifests pin.
#[derive(Clone, Debug)]
pub struct Release {
    /// The filter image repository, without tag or digest.
    pub filter_image: String,
    /// The filter image's manifest digest (`sha256:…`).
    pub filter_digest: String,
    /// SHA-256 of `plugin.wasm` (hex).
    pub wasm_sha256: String,
    /// Where plain Envoy fetches `sluice_filter.wasm` (`code.remote`).
    pub wasm_url: String,
    /// Sidecar, Redis images: `repo@sha256:…`.
    pub sidecar_image: String,
    pub redis_image: String,
}

impl Release {
    /// Reads `KEY=VALUE` lines (`#` comments) of `deploy/release.env`.
    pub fn load(root: &Path) -> anyhow::Result<Release> {
        let path = root.join("deploy/release.env");
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut vars = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| anyhow!("{}: `{line}` is not KEY=VALUE", path.display()))?;
            vars.insert(k.trim().to_string(), v.trim().to_string());
        }
        let mut get = |k: &str| {
            vars.remove(k)
                .ok_or_else(|| anyhow!("{} has no {k}", path.display()))
        };
        Ok(Release {
            filter_image: get("FILTER_IMAGE")?,
            filter_digest: get("FILTER_DIGEST")?,
            wasm_sha256: get("WASM_SHA256")?,
            wasm_url: get("WASM_URL")?,
            sidecar_image: get("SIDECAR_IMAGE")?,
            redis_image: get("REDIS_IMAGE")?,
        })
    }

    /// `repo@sha256:…` of the filter image.
    pub fn filter_ref(&self) -> String {
        format!("{}@{}", self.filter_image, self.filter_digest)
    }

    fn digest_hex(&self) -> &str {
        self.filter_digest
            .strip_prefix("sha256:")
            .unwrap_or(&self.filter_digest)
    }
}

/// The block of `envoy/sluice.yaml` that loads the filter from a file.
const LOCAL_CODE: &str = "                          code:
                            local:
                              filename: target/wasm32-wasip1/release/sluice_filter.wasm
";

/// `envoy/sluice-remote.yaml`: `envoy/sluice.yaml` with the filter fetched
/// over HTTP and checked against `sha256` (Envoy's `code.remote`), and the
/// cluster it is fetched through. Made by text substitution so every
/// comment of the original stays.
pub fn remote_envoy_yaml(sluice_yaml: &str, release: &Release) -> anyhow::Result<String> {
    if sluice_yaml.matches(LOCAL_CODE).count() != 1 {
        bail!("envoy/sluice.yaml no longer has exactly one `code: local: filename: …sluice_filter.wasm` block");
    }
    let url = &release.wasm_url;
    let authority = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .and_then(|rest| rest.split('/').next())
        .ok_or_else(|| anyhow!("WASM_URL `{url}` is not an http(s) URL"))?;
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().context("WASM_URL port")?),
        None if url.starts_with("https://") => (authority, 443),
        None => (authority, 80),
    };
    let remote = format!(
        "                          # Fetched at start (and at every listener update) through
                          # the `sluice_wasm_source` cluster below and refused unless
                          # its SHA-256 is this one. A module that does not match is
                          # never run: Envoy loads no filter and, as failure_policy
                          # is FAIL_CLOSED, answers every request 503 itself until
                          # a listener update fetches a good one (docs/src/deployment.md,
                          # \"Plain Envoy\"). `sha256sum sluice_filter.wasm` gives
                          # the value; `make image` writes the current one here.
                          code:
                            remote:
                              http_uri:
                                uri: {url}
                                cluster: sluice_wasm_source
                                timeout: 10s
                              sha256: {sha}
                              retry_policy:
                                num_retries: 3
",
        sha = release.wasm_sha256
    );
    let mut out = sluice_yaml.replacen(LOCAL_CODE, &remote, 1);
    let header_old = "# sluice in front of an OpenAI/Ollama-compatible upstream.\n";
    if !out.starts_with(header_old) {
        bail!(
            "envoy/sluice.yaml no longer starts with `{}`",
            header_old.trim()
        );
    }
    out = out.replacen(
        header_old,
        "# GENERATED by `make deploy-manifests` from envoy/sluice.yaml: edit that file.\n\
         # envoy/sluice.yaml with the filter loaded by Envoy's own remote source\n\
         # (`vm_config.code.remote`: an HTTP URI and the module's SHA-256) instead of\n\
         # a local file, for plain Envoy without a mesh. Everything else is the same.\n#\n",
        1,
    );
    out.push_str(&format!(
        "    # Where the filter is fetched from (code.remote above).
    - name: sluice_wasm_source
      type: {kind}
      connect_timeout: 5s
      load_assignment:
        cluster_name: sluice_wasm_source
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{ address: {host}, port_value: {port} }}
",
        kind = if host.parse::<std::net::IpAddr>().is_ok() {
            "STATIC"
        } else {
            "STRICT_DNS"
        },
    ));
    if url.starts_with("https://") {
        out.push_str(&format!(
            "      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          sni: {host}
"
        ));
    }
    Ok(out)
}

/// The shipped demo policy (`envoy/sluice.yaml`) with the sidecar reached
/// through `cluster` (and `authority`, the Host the sidecar's door must
/// allow).
pub fn policy_for(shipped: &EnvoyConfig, cluster: &str, authority: Option<&str>) -> Value {
    let mut cfg = shipped.clone();
    let policy = cfg.policy_mut();
    if let Some(sidecar) = policy.get_mut("sidecar").and_then(Value::as_mapping_mut) {
        sidecar.insert("cluster".into(), cluster.into());
        match authority {
            Some(a) => sidecar.insert("authority".into(), a.into()),
            None => sidecar.remove("authority"),
        };
    }
    policy.clone()
}

fn stats_tags(shipped: &EnvoyConfig) -> anyhow::Result<Value> {
    shipped
        .value()
        .get("stats_config")
        .cloned()
        .ok_or_else(|| anyhow!("envoy/sluice.yaml has no stats_config"))
}

fn yaml_doc(header: &str, v: &Value) -> anyhow::Result<String> {
    Ok(format!(
        "# GENERATED by `make deploy-manifests` ({header}); do not edit.\n{}",
        serde_yaml::to_string(v)?
    ))
}

fn literal(text: &str) -> Value {
    Value::String(text.to_string())
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    let mut m = Mapping::new();
    for (k, v) in pairs {
        m.insert(k.into(), v);
    }
    Value::Mapping(m)
}

fn parse(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap_or(Value::Null)
}

fn configmap(name: &str, key: &str, text: String) -> Value {
    map(vec![
        ("apiVersion", literal("v1")),
        ("kind", literal("ConfigMap")),
        (
            "metadata",
            map(vec![
                ("name", literal(name)),
                ("labels", parse("{app.kubernetes.io/name: sluice}")),
            ]),
        ),
        ("data", map(vec![(key, Value::String(text))])),
    ])
}

/// Every generated file, from the files under `root`, with the fleet salt
/// placeholder (what is committed).
pub fn generated_files(root: &Path) -> anyhow::Result<Vec<(String, String)>> {
    generated_files_for(root, FLEET_SALT_PLACEHOLDER, None)
}

/// Like [`generated_files`] for an operator's own render (never commit it):
/// `fleet.salt` = `salt` (`SLUICE_FLEET_SALT`), and `policy` (a policy
/// file, `SLUICE_POLICY`) instead of the demo policy of `envoy/sluice.yaml`.
pub fn generated_files_for(
    root: &Path,
    salt: &str,
    policy: Option<&Path>,
) -> anyhow::Result<Vec<(String, String)>> {
    if salt.len() < 16 {
        bail!("the fleet salt must be at least 16 bytes");
    }
    let release = Release::load(root)?;
    let sluice_yaml = fs::read_to_string(root.join("envoy/sluice.yaml"))?;
    let mut shipped = EnvoyConfig::load(&root.join("envoy/sluice.yaml"));
    if let Some(path) = policy {
        let text =
            fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        *shipped.policy_mut() =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    }
    let rules = fs::read_to_string(root.join("envoy/prometheus-rules.yaml"))?;
    let dashboard = fs::read_to_string(root.join("envoy/grafana-dashboard.json"))?;
    let mut out = Vec::new();

    out.push((
        "envoy/sluice-remote.yaml".to_string(),
        remote_envoy_yaml(&sluice_yaml, &release)?,
    ));

    // The policy as a ConfigMap (check-config, the fleet agent's `policy`):
    // the sidecar behind a cluster named `sluice_sidecar` (plain Envoy,
    // Envoy Gateway's bootstrap cluster).
    let base_policy = policy_for(&shipped, "sluice_sidecar", None);
    out.push((
        "deploy/base/policy.yaml".into(),
        yaml_doc(
            "the policy of envoy/sluice.yaml",
            &configmap(
                "sluice-policy",
                "policy.yaml",
                serde_yaml::to_string(&base_policy)?,
            ),
        )?,
    ));

    // Istio: the sidecar's cluster is Istio's name for the Service port, and
    // the Host the filter sends is the Service's DNS name (the sidecar's
    // door allows it through --allowed-host).
    let istio_policy = policy_for(&shipped, &istio_sidecar_cluster(), Some(&sidecar_host()));
    out.push((
        "deploy/overlays/istio/policy.yaml".into(),
        yaml_doc(
            "the policy of envoy/sluice.yaml, Istio's sidecar cluster",
            &configmap(
                "sluice-policy",
                "policy.yaml",
                serde_yaml::to_string(&istio_policy)?,
            ),
        )?,
    ));
    let mut shipped_filter = shipped.clone();
    let filter_config = shipped_filter.http_filter_mut("sluice")["typed_config"]["config"].clone();
    out.push((
        "deploy/overlays/istio/envoyfilter.yaml".into(),
        yaml_doc(
            "envoy/sluice.yaml's filter and policy, deploy/release.env",
            &istio_envoyfilter(&filter_config, istio_policy, &release)?,
        )?,
    ));
    let bootstrap = serde_json::to_string_pretty(&serde_json::json!({
        "stats_config": serde_json::to_value(stats_tags(&shipped)?)?,
    }))?;
    out.push((
        "deploy/overlays/istio/bootstrap-override.yaml".into(),
        yaml_doc(
            "envoy/sluice.yaml's stats_config",
            &configmap("sluice-istio-bootstrap", "custom_bootstrap.json", bootstrap),
        )?,
    ));

    // Envoy Gateway: the sidecar cluster and the stats tags come in through
    // the EnvoyProxy's bootstrap merge; the filter from the OCI image.
    let eg_bootstrap = map(vec![
        ("stats_config", stats_tags(&shipped)?),
        (
            "static_resources",
            parse(&format!(
                "clusters:
  - name: sluice_sidecar
    type: STRICT_DNS
    connect_timeout: 1s
    load_assignment:
      cluster_name: sluice_sidecar
      endpoints:
        - lb_endpoints:
            - endpoint:
                address:
                  socket_address: {{ address: {host}, port_value: {SIDECAR_PORT} }}
",
                host = sidecar_host()
            )),
        ),
    ]);
    let envoyproxy = map(vec![
        ("apiVersion", literal("gateway.envoyproxy.io/v1alpha1")),
        ("kind", literal("EnvoyProxy")),
        ("metadata", parse("{name: sluice}")),
        (
            "spec",
            map(vec![(
                "bootstrap",
                map(vec![
                    ("type", literal("Merge")),
                    (
                        "value",
                        Value::String(serde_yaml::to_string(&eg_bootstrap)?),
                    ),
                ]),
            )]),
        ),
    ]);
    out.push((
        "deploy/overlays/envoy-gateway/envoyproxy.yaml".into(),
        yaml_doc("envoy/sluice.yaml's stats_config", &envoyproxy)?,
    ));
    let eep = map(vec![
        ("apiVersion", literal("gateway.envoyproxy.io/v1alpha1")),
        ("kind", literal("EnvoyExtensionPolicy")),
        ("metadata", parse("{name: sluice}")),
        (
            "spec",
            map(vec![
                (
                    "targetRefs",
                    parse("[{group: gateway.networking.k8s.io, kind: Gateway, name: llm-gateway}]"),
                ),
                (
                    "wasm",
                    Value::Sequence(vec![map(vec![
                        ("name", literal("sluice")),
                        ("rootID", literal("sluice")),
                        (
                            "code",
                            map(vec![
                                ("type", literal("Image")),
                                (
                                    "image",
                                    map(vec![
                                        ("url", Value::String(release.filter_ref())),
                                        ("sha256", Value::String(release.digest_hex().to_string())),
                                    ]),
                                ),
                            ]),
                        ),
                        ("failOpen", Value::Bool(false)),
                        ("config", base_policy.clone()),
                    ])]),
                ),
            ]),
        ),
    ]);
    out.push((
        "deploy/overlays/envoy-gateway/envoyextensionpolicy.yaml".into(),
        yaml_doc("envoy/sluice.yaml's policy, deploy/release.env", &eep)?,
    ));
    out.push((
        "deploy/overlays/envoy-gateway/envoypatchpolicy.yaml".into(),
        yaml_doc(
            "the wasm filter's name in Envoy Gateway",
            &eg_patch_policy(),
        )?,
    ));

    // Fleet (on top of envoy-gateway): every gateway pod runs the fleet
    // agent beside Envoy (its fleet endpoints answer loopback only), so the
    // filter's sidecar cluster is 127.0.0.1:9911; the policy gets `fleet:`.
    let mut fleet_policy = base_policy.clone();
    if let Some(p) = fleet_policy.as_mapping_mut() {
        p.insert(
            "fleet".into(),
            parse(&format!(
                "expected_replicas: {FLEET_REPLICAS}\n\
                 # The same on every Envoy of the fleet, at least 16 bytes. sluice\n\
                 # reads it from the policy only: replace it (`openssl rand -hex 16`)\n\
                 # and keep this object readable by operators alone.\n\
                 salt: {salt}\n\
                 secret_env: SLUICE_FLEET_SECRET\n"
            )),
        );
    }
    out.push((
        "deploy/overlays/fleet/policy.yaml".into(),
        yaml_doc(
            "the policy of envoy/sluice.yaml with fleet:",
            &configmap(
                "sluice-policy",
                "policy.yaml",
                serde_yaml::to_string(&fleet_policy)?,
            ),
        )?,
    ));
    let mut fleet_eep = eep.clone();
    if let Some(w) = fleet_eep["spec"]["wasm"][0].as_mapping_mut() {
        w.insert("config".into(), fleet_policy);
        // The VM reads the fleet secret from Envoy's environment.
        w.insert("env".into(), parse("{hostKeys: [SLUICE_FLEET_SECRET]}"));
    }
    out.push((
        "deploy/overlays/fleet/envoyextensionpolicy.yaml".into(),
        yaml_doc(
            "envoy/sluice.yaml's policy with fleet:, deploy/release.env",
            &fleet_eep,
        )?,
    ));
    let mut fleet_bootstrap = eg_bootstrap.clone();
    fleet_bootstrap["static_resources"] = parse(
        "clusters:
  - name: sluice_sidecar
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: sluice_sidecar
      endpoints:
        - lb_endpoints:
            - endpoint:
                address:
                  socket_address: { address: 127.0.0.1, port_value: 9911 }
",
    );
    let agent = parse(&format!(
        "spec:
  template:
    spec:
      containers:
        - name: envoy
          env:
            - name: SLUICE_FLEET_SECRET
              valueFrom: {{ secretKeyRef: {{ name: sluice-fleet, key: secret }} }}
        - name: sluice-fleet-agent
          image: {image}
          args: [serve, --config, /etc/sluice/sidecar.yaml]
          ports: [{{ name: sluice, containerPort: 9911 }}]
          readinessProbe: {{ httpGet: {{ path: /healthz, port: 9911 }}, periodSeconds: 5 }}
          livenessProbe: {{ httpGet: {{ path: /healthz, port: 9911 }}, periodSeconds: 10 }}
          resources:
            requests: {{ cpu: 50m, memory: 64Mi }}
            limits: {{ memory: 256Mi }}
          securityContext:
            runAsNonRoot: true
            runAsUser: 65532
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {{ drop: [ALL] }}
          volumeMounts:
            - {{ name: sluice-config, mountPath: /etc/sluice/sidecar.yaml, subPath: sidecar.yaml, readOnly: true }}
            - {{ name: sluice-policy, mountPath: /etc/sluice/policy, readOnly: true }}
            - {{ name: sluice-admin, mountPath: /etc/sluice/admin, readOnly: true }}
            - {{ name: sluice-fleet, mountPath: /etc/sluice/fleet, readOnly: true }}
            - {{ name: sluice-state, mountPath: /var/lib/sluice }}
      volumes:
        - {{ name: sluice-config, configMap: {{ name: sluice-sidecar-config }} }}
        - {{ name: sluice-policy, configMap: {{ name: sluice-policy }} }}
        - {{ name: sluice-admin, secret: {{ secretName: sluice-admin, defaultMode: 0400 }} }}
        - {{ name: sluice-fleet, secret: {{ secretName: sluice-fleet, defaultMode: 0400 }} }}
        - {{ name: sluice-state, emptyDir: {{}} }}
",
        image = release.sidecar_image
    ));
    let fleet_envoyproxy = map(vec![
        ("apiVersion", literal("gateway.envoyproxy.io/v1alpha1")),
        ("kind", literal("EnvoyProxy")),
        ("metadata", parse("{name: sluice}")),
        (
            "spec",
            map(vec![
                (
                    "provider",
                    map(vec![
                        ("type", literal("Kubernetes")),
                        (
                            "kubernetes",
                            map(vec![(
                                "envoyDeployment",
                                map(vec![
                                    ("replicas", Value::from(FLEET_REPLICAS)),
                                    (
                                        "patch",
                                        map(vec![
                                            ("type", literal("StrategicMerge")),
                                            ("value", agent),
                                        ]),
                                    ),
                                ]),
                            )]),
                        ),
                    ]),
                ),
                (
                    "bootstrap",
                    map(vec![
                        ("type", literal("Merge")),
                        (
                            "value",
                            Value::String(serde_yaml::to_string(&fleet_bootstrap)?),
                        ),
                    ]),
                ),
            ]),
        ),
    ]);
    out.push((
        "deploy/overlays/fleet/envoyproxy.yaml".into(),
        yaml_doc(
            "envoy/sluice.yaml's stats_config, deploy/release.env",
            &fleet_envoyproxy,
        )?,
    ));

    // Monitoring: the alert rules and the dashboard as Kubernetes objects.
    let rules_value: Value = serde_yaml::from_str(&rules).context("envoy/prometheus-rules.yaml")?;
    let groups = rules_value
        .get("groups")
        .cloned()
        .ok_or_else(|| anyhow!("envoy/prometheus-rules.yaml has no groups"))?;
    let prometheusrule = map(vec![
        ("apiVersion", literal("monitoring.coreos.com/v1")),
        ("kind", literal("PrometheusRule")),
        (
            "metadata",
            parse("{name: sluice, labels: {app.kubernetes.io/name: sluice}}"),
        ),
        ("spec", map(vec![("groups", groups)])),
    ]);
    out.push((
        "deploy/monitoring/prometheusrule.yaml".into(),
        yaml_doc("envoy/prometheus-rules.yaml", &prometheusrule)?,
    ));
    let mut dash = configmap("sluice-grafana-dashboard", "sluice.json", dashboard);
    if let Some(labels) = dash
        .get_mut("metadata")
        .and_then(|m| m.get_mut("labels"))
        .and_then(Value::as_mapping_mut)
    {
        // What Grafana's dashboard sidecar (kube-prometheus-stack) picks up.
        labels.insert("grafana_dashboard".into(), "1".into());
    }
    out.push((
        "deploy/monitoring/grafana-dashboard.yaml".into(),
        yaml_doc("envoy/grafana-dashboard.json", &dash)?,
    ));

    // Images pinned by digest where the hand-written manifests use them.
    let images = format!(
        "# GENERATED by `make deploy-manifests` (deploy/release.env); do not edit.
# Every image the manifests run, pinned by digest (kustomize `images:`).
apiVersion: kustomize.config.k8s.io/v1alpha1
kind: Component
images:
  - name: sluice-sidecar
    newName: {sidecar_name}
    digest: {sidecar_digest}
  - name: redis
    newName: {redis_name}
    digest: {redis_digest}
",
        sidecar_name = split_ref(&release.sidecar_image)?.0,
        sidecar_digest = split_ref(&release.sidecar_image)?.1,
        redis_name = split_ref(&release.redis_image)?.0,
        redis_digest = split_ref(&release.redis_image)?.1,
    );
    out.push(("deploy/components/images/kustomization.yaml".into(), images));
    Ok(out)
}

/// `repo@sha256:…` → (`repo`, `sha256:…`).
fn split_ref(image: &str) -> anyhow::Result<(&str, &str)> {
    image
        .split_once('@')
        .filter(|(_, d)| d.starts_with("sha256:"))
        .ok_or_else(|| anyhow!("`{image}` is not pinned by digest (repo@sha256:…)"))
}

/// The name of the `ExtensionConfig` (ECDS resource) the Istio EnvoyFilter
/// adds, and of the HTTP filter that loads it.
pub const ISTIO_EXTENSION_NAME: &str = "sluice";

/// The Istio overlay's `EnvoyFilter`: an `EXTENSION_CONFIG` ADD carrying the
/// whole Wasm filter config (what a `WasmPlugin` would generate, plus
/// `allow_on_headers_stop_iteration: true`, which WasmPlugin cannot set),
/// and an `HTTP_FILTER` INSERT_BEFORE the router that loads it by name
/// through ECDS (`config_discovery` over ADS). `filter_config` is the
/// shipped filter's `PluginConfig` (envoy/sluice.yaml); its code becomes
/// the OCI image by digest, which istio-agent pulls for ECDS Wasm configs
/// (`remote.http_uri` with `oci://`, as it does for a WasmPlugin) and
/// rewrites to a local file before Envoy sees it.
pub fn istio_envoyfilter(
    filter_config: &Value,
    policy: Value,
    release: &Release,
) -> anyhow::Result<Value> {
    let mut config = filter_config.clone();
    let c = config
        .as_mapping_mut()
        .ok_or_else(|| anyhow!("envoy/sluice.yaml: the sluice filter has no config"))?;
    if c.get("allow_on_headers_stop_iteration") != Some(&Value::Bool(true)) {
        bail!(
            "envoy/sluice.yaml: the sluice filter must set allow_on_headers_stop_iteration: true"
        );
    }
    if c.get("failure_policy").and_then(Value::as_str) != Some("FAIL_CLOSED") {
        bail!("envoy/sluice.yaml: the sluice filter must fail closed");
    }
    let code = parse(&format!(
        "remote:
  http_uri:
    uri: oci://{image}
    timeout: 30s
  sha256: {digest}
",
        image = release.filter_ref(),
        digest = release.digest_hex()
    ));
    config["vm_config"]["code"] = code;
    config["configuration"] = map(vec![
        (
            "@type",
            literal("type.googleapis.com/google.protobuf.Struct"),
        ),
        ("value", policy),
    ]);
    let wasm_type = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
    let extension = map(vec![
        ("name", literal(ISTIO_EXTENSION_NAME)),
        (
            "typed_config",
            map(vec![("@type", literal(wasm_type)), ("config", config)]),
        ),
    ]);
    let http_filter = parse(&format!(
        "name: {ISTIO_EXTENSION_NAME}
config_discovery:
  config_source:
    ads: {{}}
    initial_fetch_timeout: 0s
  type_urls: [{wasm_type}]
"
    ));
    Ok(map(vec![
        ("apiVersion", literal("networking.istio.io/v1alpha3")),
        ("kind", literal("EnvoyFilter")),
        ("metadata", parse("{name: sluice}")),
        (
            "spec",
            map(vec![
                // The workloads whose istio-proxy loads sluice: your LLM
                // gateway's pods (here the ingress gateway's labels).
                (
                    "workloadSelector",
                    parse("{labels: {istio: ingressgateway}}"),
                ),
                (
                    "configPatches",
                    Value::Sequence(vec![
                        map(vec![
                            ("applyTo", literal("EXTENSION_CONFIG")),
                            (
                                "patch",
                                map(vec![("operation", literal("ADD")), ("value", extension)]),
                            ),
                        ]),
                        map(vec![
                            ("applyTo", literal("HTTP_FILTER")),
                            (
                                "match",
                                parse(
                                    "context: GATEWAY
listener:
  filterChain:
    filter:
      name: envoy.filters.network.http_connection_manager
      subFilter:
        name: envoy.filters.http.router
",
                                ),
                            ),
                            (
                                "patch",
                                map(vec![
                                    ("operation", literal("INSERT_BEFORE")),
                                    ("value", http_filter),
                                ]),
                            ),
                        ]),
                    ]),
                ),
            ]),
        ),
    ]))
}

/// The Gateway, its namespace and listener (gateway.yaml) the
/// EnvoyExtensionPolicy and the EnvoyPatchPolicy target.
pub const EG_GATEWAY: &str = "llm-gateway";
pub const EG_LISTENER: &str = "http";
/// The EnvoyExtensionPolicy's name and the index of sluice in its `wasm`.
pub const EG_POLICY: &str = "sluice";

/// The name Envoy Gateway gives the HTTP filter of the `index`th `wasm`
/// entry of an EnvoyExtensionPolicy: `envoy.filters.http.wasm/` and the
/// IR name `envoyextensionpolicy/<namespace>/<policy>/wasm/<index>`
/// (Envoy Gateway's xDS translator, internal/xds/translator/wasm.go).
pub fn eg_wasm_filter_name(index: usize) -> String {
    format!("envoy.filters.http.wasm/envoyextensionpolicy/{NAMESPACE}/{EG_POLICY}/wasm/{index}")
}

/// The name of the xDS Listener Envoy Gateway makes for a Gateway listener:
/// `<namespace>/<gateway>/<listener>`.
pub fn eg_listener_name() -> String {
    format!("{NAMESPACE}/{EG_GATEWAY}/{EG_LISTENER}")
}

/// The Envoy Gateway overlay's `EnvoyPatchPolicy`: sets
/// `allow_on_headers_stop_iteration: true` on the wasm filter the
/// EnvoyExtensionPolicy generates (the API has no field for it). The filter
/// is found by name with `jsonPath` (wherever the HTTP connection manager
/// sits in the listener), and `path` is appended to each match.
/// EnvoyPatchPolicy is off in Envoy Gateway until its own config sets
/// `extensionApis.enableEnvoyPatchPolicy: true`.
pub fn eg_patch_policy() -> Value {
    map(vec![
        ("apiVersion", literal("gateway.envoyproxy.io/v1alpha1")),
        ("kind", literal("EnvoyPatchPolicy")),
        (
            "metadata",
            parse("{name: sluice-allow-on-headers-stop-iteration}"),
        ),
        (
            "spec",
            map(vec![
                (
                    "targetRef",
                    parse(&format!(
                        "{{group: gateway.networking.k8s.io, kind: Gateway, name: {EG_GATEWAY}}}"
                    )),
                ),
                ("type", literal("JSONPatch")),
                (
                    "jsonPatches",
                    Value::Sequence(vec![map(vec![
                        (
                            "type",
                            literal("type.googleapis.com/envoy.config.listener.v3.Listener"),
                        ),
                        ("name", Value::String(eg_listener_name())),
                        (
                            "operation",
                            map(vec![
                                ("op", literal("add")),
                                (
                                    "jsonPath",
                                    Value::String(format!(
                                        "..http_filters[?(@.name=='{}')]",
                                        eg_wasm_filter_name(0)
                                    )),
                                ),
                                (
                                    "path",
                                    literal("/typed_config/config/allow_on_headers_stop_iteration"),
                                ),
                                ("value", Value::Bool(true)),
                            ]),
                        ),
                    ])]),
                ),
            ]),
        ),
    ])
}
