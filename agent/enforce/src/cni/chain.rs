//! The node's CNI configuration with `peerwall-boot` chained last, or taken out again (pure:
//! file names and JSON in, JSON out).
//!
//! The container runtime runs the plugins of the first configuration file of its directory
//! in name order (libcni `ConfFiles`: `.conf`, `.conflist`, `.json`), each ADD after the one
//! before it, with the previous result. A chained plugin goes in a `.conflist`'s `plugins`;
//! a single-plugin `.conf` holds no chain.

use serde_json::{json, Value};

/// The plugin's `type`: its binary's name in the runtime's CNI binary directory.
pub const PLUGIN: &str = "peerwall-boot";

/// Why the configuration cannot take the plugin.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// No configuration file: the node's network plugin has not written one yet.
    #[error("no CNI configuration (*.conflist, *.conf, *.json) in {dir}: the node's network plugin has not written one yet")]
    NoConfig {
        /// The directory looked in.
        dir: String,
    },
    /// The file in force holds one plugin, not a chain.
    #[error("{file}: a single-plugin configuration (no \"plugins\" list): {PLUGIN} can only be chained into a .conflist")]
    NotAList {
        /// The file.
        file: String,
    },
    /// The file is not JSON, or its `plugins` is not a list.
    #[error("{file}: {why}")]
    Malformed {
        /// The file.
        file: String,
        /// What is wrong, with the field.
        why: String,
    },
}

/// The file the runtime uses among `names` (file names of the configuration directory): the
/// first in name order with a CNI configuration's extension.
pub fn in_force(names: &[String]) -> Option<&String> {
    let mut candidates: Vec<&String> = names
        .iter()
        .filter(|n| {
            [".conflist", ".conf", ".json"]
                .iter()
                .any(|e| n.ends_with(e))
        })
        .collect();
    candidates.sort();
    candidates.into_iter().next()
}

/// The plugin's entry: which pods' sandboxes get the boot policy.
pub fn entry(pod_name_prefixes: &[String]) -> Value {
    json!({"type": PLUGIN, "podNamePrefixes": pod_name_prefixes})
}

/// `text` (the file `file`) with `wanted` as the last plugin, replacing any entry of ours
/// elsewhere; None when it is already exactly so.
pub fn chained(file: &str, text: &str, wanted: &Value) -> Result<Option<String>, ChainError> {
    let mut doc = parse(file, text)?;
    let plugins = plugins_mut(file, &mut doc)?;
    if plugins.last() == Some(wanted) && plugins.iter().filter(|p| is_ours(p)).count() == 1 {
        return Ok(None);
    }
    plugins.retain(|p| !is_ours(p));
    plugins.push(wanted.clone());
    Ok(Some(to_text(&doc)))
}

/// `text` without our entry; None when it holds none (or is not a list at all).
pub fn unchained(file: &str, text: &str) -> Option<String> {
    let mut doc = parse(file, text).ok()?;
    let plugins = plugins_mut(file, &mut doc).ok()?;
    let before = plugins.len();
    plugins.retain(|p| !is_ours(p));
    (plugins.len() != before).then(|| to_text(&doc))
}

/// Whether `text` chains our plugin.
pub fn is_chained(file: &str, text: &str) -> bool {
    parse(file, text)
        .ok()
        .and_then(|d| d.get("plugins").and_then(Value::as_array).cloned())
        .is_some_and(|ps| ps.iter().any(is_ours))
}

fn is_ours(p: &Value) -> bool {
    p.get("type").and_then(Value::as_str) == Some(PLUGIN)
}

fn parse(file: &str, text: &str) -> Result<Value, ChainError> {
    serde_json::from_str(text).map_err(|e| ChainError::Malformed {
        file: file.into(),
        why: format!("not JSON: {e}"),
    })
}

fn plugins_mut<'a>(file: &str, doc: &'a mut Value) -> Result<&'a mut Vec<Value>, ChainError> {
    match doc.get_mut("plugins") {
        None => Err(ChainError::NotAList { file: file.into() }),
        Some(Value::Array(list)) => Ok(list),
        Some(other) => Err(ChainError::Malformed {
            file: file.into(),
            why: format!("plugins: {other} is not a list"),
        }),
    }
}

fn to_text(doc: &Value) -> String {
    // Pretty and newline-terminated, as network plugins write theirs.
    let mut s = serde_json::to_string_pretty(doc).unwrap_or_else(|_| doc.to_string());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const BRIDGE: &str = r#"{"cniVersion": "0.4.0", "name": "pods", "plugins": [
        {"type": "bridge", "bridge": "cni0"}, {"type": "portmap"}]}"#;

    #[test]
    fn the_runtime_uses_the_first_configuration_file_by_name() {
        let names: Vec<String> = ["99-z.conflist", "README", "10-calico.conflist", "20-a.conf"]
            .map(String::from)
            .to_vec();
        assert_eq!(in_force(&names).unwrap(), "10-calico.conflist");
        assert_eq!(in_force(&["notes.txt".to_string()]), None);
    }

    #[test]
    fn the_plugin_goes_last_once_and_comes_out_again() {
        let want = entry(&["gw-".into()]);
        let once = chained("f", BRIDGE, &want).unwrap().unwrap();
        let doc: Value = serde_json::from_str(&once).unwrap();
        let plugins = doc["plugins"].as_array().unwrap();
        assert_eq!(plugins.len(), 3);
        assert_eq!(plugins[0]["type"], "bridge");
        assert_eq!(plugins[2], want);
        assert_eq!(doc["name"], "pods");
        assert!(is_chained("f", &once));
        // Already so: nothing to write.
        assert_eq!(chained("f", &once, &want).unwrap(), None);
        // Another prefix list replaces ours, still once.
        let other = entry(&["gw-".into(), "liqo-gw-".into()]);
        let again = chained("f", &once, &other).unwrap().unwrap();
        let doc: Value = serde_json::from_str(&again).unwrap();
        assert_eq!(doc["plugins"].as_array().unwrap().len(), 3);
        // A plugin the network plugin appended after ours: ours moves back to the end.
        let mut moved: Value = serde_json::from_str(&once).unwrap();
        moved["plugins"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "tuning"}));
        let fixed = chained("f", &moved.to_string(), &want).unwrap().unwrap();
        let doc: Value = serde_json::from_str(&fixed).unwrap();
        assert_eq!(doc["plugins"].as_array().unwrap().last().unwrap(), &want);
        assert_eq!(doc["plugins"].as_array().unwrap().len(), 4);
        let out = unchained("f", &once).unwrap();
        let doc: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(doc, serde_json::from_str::<Value>(BRIDGE).unwrap());
        assert!(!is_chained("f", &out));
        assert_eq!(unchained("f", &out), None);
    }

    #[test]
    fn what_holds_no_chain_is_said_and_left_alone() {
        let single = r#"{"cniVersion": "0.4.0", "name": "pods", "type": "bridge"}"#;
        let want = entry(&["gw-".into()]);
        assert_eq!(
            chained("10-pods.conf", single, &want),
            Err(ChainError::NotAList {
                file: "10-pods.conf".into()
            })
        );
        assert!(matches!(
            chained("x.conflist", "{", &want),
            Err(ChainError::Malformed { .. })
        ));
        let e = chained("x.conflist", r#"{"plugins": 3}"#, &want).unwrap_err();
        assert_eq!(e.to_string(), "x.conflist: plugins: 3 is not a list");
        assert_eq!(unchained("10-pods.conf", single), None);
    }
}
