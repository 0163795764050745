//! Helpers for the CRD schemas peerwall generates from its types.

/// Remove every schema `default`: the API server would apply them (and v1.20 rejects an
/// empty-string default as "null"), while peerwall's readers treat absent fields themselves
/// and report them with their path.
pub fn strip_defaults(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            o.remove("default");
            o.values_mut().for_each(strip_defaults);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_defaults),
        _ => {}
    }
}
