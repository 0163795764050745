//! `peerwall-boot`, run by the container runtime as a chained CNI plugin (the `peerwall`
//! binary, copied into the runtime's CNI binary directory; `CNI_COMMAND` in its environment
//! and no argument selects this mode).
//!
//! ADD for a pod whose name starts with one of `podNamePrefixes` (Liqo names its gateway
//! Deployments `gw-<name>`: `pkg/gateway/forge/utils.go`): the node boot policy
//! ([`crate::protection::boot::node_boot_object`]) goes in force in the pod's network
//! namespace, as the nftables table `peerwall-boot`, before any container of the pod starts.
//! If it cannot, the ADD fails and the runtime does not start the pod (it retries): a gateway
//! never runs unfiltered. Other pods: the previous plugin's result, untouched. DEL, CHECK,
//! STATUS and GC have nothing to undo (the table goes with the namespace).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;

use anyhow::{anyhow, Context};
use serde_json::{json, Value};

/// CNI versions this plugin speaks (the result is the previous plugin's, in its version).
pub const VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// What one invocation does, decided from its environment and configuration (pure).
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Put the boot policy in force in this network namespace, then pass the result on.
    Boot {
        /// The sandbox's network namespace (`CNI_NETNS`).
        netns: String,
        /// `namespace/name`, for the error message.
        pod: String,
    },
    /// Pass the previous result on (ADD of another pod).
    Pass,
    /// Nothing to print (DEL, CHECK, STATUS, GC).
    Nothing,
    /// Print the versions spoken.
    Version,
    /// A command this plugin does not know.
    Unknown(String),
}

/// The keys of `CNI_ARGS` (`K=V;K=V`).
pub fn cni_args(s: &str) -> BTreeMap<&str, &str> {
    s.split(';').filter_map(|kv| kv.split_once('=')).collect()
}

/// What `command` with `args` (`CNI_ARGS`), `netns` (`CNI_NETNS`) and the plugin's
/// configuration asks for.
pub fn decide(command: &str, args: &str, netns: Option<&str>, conf: &Value) -> Action {
    match command {
        "ADD" => {
            let a = cni_args(args);
            let name = a.get("K8S_POD_NAME").copied().unwrap_or_default();
            let prefixes: Vec<&str> = conf
                .get("podNamePrefixes")
                .and_then(Value::as_array)
                .map(|l| l.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let matches = !name.is_empty()
                && prefixes
                    .iter()
                    .any(|p| !p.is_empty() && name.starts_with(p));
            match (matches, netns) {
                (true, Some(ns)) if !ns.is_empty() => Action::Boot {
                    netns: ns.to_string(),
                    pod: format!(
                        "{}/{name}",
                        a.get("K8S_POD_NAMESPACE").copied().unwrap_or_default()
                    ),
                },
                _ => Action::Pass,
            }
        }
        "DEL" | "CHECK" | "STATUS" | "GC" => Action::Nothing,
        "VERSION" => Action::Version,
        other => Action::Unknown(other.to_string()),
    }
}

/// The result to print after an ADD: the previous plugin's, in the configuration's version;
/// an empty one when this plugin is first (not chained as it should be, but harmless).
pub fn result(conf: &Value) -> Value {
    let version = version_of(conf);
    match conf.get("prevResult") {
        Some(Value::Object(prev)) => {
            let mut r = prev.clone();
            r.insert("cniVersion".into(), json!(version));
            Value::Object(r)
        }
        _ => json!({"cniVersion": version, "interfaces": [], "ips": [], "dns": {}}),
    }
}

/// A CNI error (`code` 999: plugin-specific) in the configuration's version.
pub fn error(conf: &Value, msg: &str, details: &str) -> Value {
    json!({"cniVersion": version_of(conf), "code": 999, "msg": msg, "details": details})
}

fn version_of(conf: &Value) -> String {
    conf.get("cniVersion")
        .and_then(Value::as_str)
        .unwrap_or("0.4.0")
        .to_string()
}

/// Whether this process was started by a container runtime as a CNI plugin.
pub fn invoked_as_plugin() -> bool {
    std::env::var_os("CNI_COMMAND").is_some() && std::env::args_os().len() == 1
}

/// Run as the plugin: the exit code (0, or 1 with a CNI error on standard output).
pub fn main() -> i32 {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let mut stdin = String::new();
    // VERSION may come without a configuration.
    let _ = std::io::stdin().read_to_string(&mut stdin);
    let conf: Value = serde_json::from_str(&stdin).unwrap_or(Value::Null);
    let action = decide(
        &command,
        &std::env::var("CNI_ARGS").unwrap_or_default(),
        std::env::var("CNI_NETNS").ok().as_deref(),
        &conf,
    );
    let (code, out) = match action {
        Action::Boot { netns, pod } => match put_boot_in_force(&netns) {
            Ok(()) => (0, Some(result(&conf))),
            Err(e) => (
                1,
                Some(error(
                    &conf,
                    &format!("{}: could not put the gateway's boot policy in force in {pod}'s network namespace", crate::cni::chain::PLUGIN),
                    &format!("{e:#}"),
                )),
            ),
        },
        Action::Pass => (0, Some(result(&conf))),
        Action::Nothing => (0, None),
        Action::Version => (
            0,
            Some(json!({"cniVersion": version_of(&conf), "supportedVersions": VERSIONS})),
        ),
        Action::Unknown(c) => (
            1,
            Some(json!({"cniVersion": version_of(&conf), "code": 4, "msg": format!("unknown CNI_COMMAND {c:?}")})),
        ),
    };
    if let Some(v) = out {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{v}");
    }
    code
}

/// The node boot policy in force in the network namespace at `netns`, through nftables,
/// unless peerwall already enforces there (a repeated ADD).
fn put_boot_in_force(netns: &str) -> anyhow::Result<()> {
    let policy = crate::enforcement::boot_policy(crate::protection::boot::node_boot_object(
        &crate::protection::boot::default_options(),
    ))?;
    let f = std::fs::File::open(netns).with_context(|| format!("opening {netns}"))?;
    // SAFETY: setns on a valid namespace descriptor; this process has one thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(anyhow!(
            "entering {netns}: {}",
            std::io::Error::last_os_error()
        ));
    }
    peerwall_backend_select::installed::hold_boot_in_nftables(&policy)
        .context("putting the boot table in force (is `nft` installed on the node?)")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARGS: &str =
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=liqo-tenant-b;K8S_POD_NAME=gw-b-5d8f-x2;K8S_POD_INFRA_CONTAINER_ID=abc";

    fn conf() -> Value {
        json!({"cniVersion": "0.4.0", "name": "pods", "type": "peerwall-boot",
               "podNamePrefixes": ["gw-"],
               "prevResult": {"cniVersion": "0.4.0", "interfaces": [{"name": "eth0"}],
                              "ips": [{"version": "4", "address": "10.244.0.7/24"}]}})
    }

    #[test]
    fn only_gateway_pods_get_the_boot_policy() {
        assert_eq!(
            decide("ADD", ARGS, Some("/var/run/netns/cni-1"), &conf()),
            Action::Boot {
                netns: "/var/run/netns/cni-1".into(),
                pod: "liqo-tenant-b/gw-b-5d8f-x2".into()
            }
        );
        let web = ARGS.replace("gw-b-5d8f-x2", "web-1");
        assert_eq!(decide("ADD", &web, Some("/n"), &conf()), Action::Pass);
        // No prefixes, an empty prefix, no pod name, no namespace: nothing is put anywhere.
        let mut none = conf();
        none["podNamePrefixes"] = json!([""]);
        assert_eq!(decide("ADD", ARGS, Some("/n"), &none), Action::Pass);
        none.as_object_mut().unwrap().remove("podNamePrefixes");
        assert_eq!(decide("ADD", ARGS, Some("/n"), &none), Action::Pass);
        assert_eq!(
            decide("ADD", "IgnoreUnknown=1", Some("/n"), &conf()),
            Action::Pass
        );
        assert_eq!(decide("ADD", ARGS, None, &conf()), Action::Pass);
        for c in ["DEL", "CHECK", "STATUS", "GC"] {
            assert_eq!(decide(c, ARGS, Some("/n"), &conf()), Action::Nothing);
        }
        assert_eq!(decide("VERSION", "", None, &Value::Null), Action::Version);
        assert_eq!(
            decide("FROB", "", None, &Value::Null),
            Action::Unknown("FROB".into())
        );
    }

    #[test]
    fn the_previous_result_is_passed_on_in_the_configurations_version() {
        let r = result(&conf());
        assert_eq!(r["ips"][0]["address"], "10.244.0.7/24");
        assert_eq!(r["cniVersion"], "0.4.0");
        let first = result(&json!({"cniVersion": "1.0.0"}));
        assert_eq!(first["cniVersion"], "1.0.0");
        assert_eq!(first["ips"], json!([]));
        let e = error(&conf(), "m", "d");
        assert_eq!(
            (e["code"].as_u64(), e["msg"].as_str()),
            (Some(999), Some("m"))
        );
    }
}
