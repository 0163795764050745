//! Liqo's objects peerwall reads, as a cluster running Liqo holds them: the `Configuration` CRD
//! (`networking.liqo.io/v1beta1`) and a peer's `Configuration`. Liqo creates a peer's
//! `Configuration` in its tenant namespace, and waits for its status, before it creates the
//! peer's gateways (`pkg/liqoctl/network/handler.go`, `RunConnect` → `initNetworkConfigs`);
//! until peerwall's controller has read it, nothing from that peer's tunnel is forwarded.

/// Liqo's `Configuration` CRD: a schema that keeps every field (Liqo's own is
/// `deployments/liqo/charts/liqo-crds/crds/networking.liqo.io_configurations.yaml`; peerwall
/// reads `spec.remote.cidr` and `status.remote.cidr`).
pub const CONFIGURATION_CRD: &str = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: configurations.networking.liqo.io}
spec:
  group: networking.liqo.io
  scope: Namespaced
  names: {plural: configurations, singular: configuration, kind: Configuration, listKind: ConfigurationList}
  versions:
    - name: v1beta1
      served: true
      storage: true
      subresources: {status: {}}
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;

/// Liqo's `Configuration` of `peer` in its tenant namespace `liqo-tenant-<peer>`: the peer's
/// pod CIDRs (`pod`) as it writes them, no external CIDR, no remapping (no status).
pub fn configuration(peer: &str, pod: &[&str]) -> String {
    format!(
        r#"apiVersion: networking.liqo.io/v1beta1
kind: Configuration
metadata:
  name: {peer}
  namespace: liqo-tenant-{peer}
  labels: {{liqo.io/remote-cluster-id: "{peer}"}}
spec:
  remote:
    cidr: {{pod: [{}], external: []}}
"#,
        pod.join(", ")
    )
}
