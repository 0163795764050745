//! Whether a FirewallConfiguration fits where users store it: the API server and etcd limit an
//! object's size, and `kubectl apply` (client-side) copies the whole object into an annotation
//! whose size is limited far below that. A policy that compiles may still not be storable; the
//! CLI says so before a user finds out from `kubectl` (`compile` and `verdict` warn). Pure: the
//! size is the object's JSON encoding, as the API server stores it.

/// The most an object's annotations may hold together (apimachinery's
/// `TotalAnnotationSizeLimitB`, `pkg/api/validation/objectmeta.go`): `kubectl apply` without
/// `--server-side` stores the object in `kubectl.kubernetes.io/last-applied-configuration`, so
/// an object larger than this cannot be applied that way ("metadata.annotations: Too long").
pub const ANNOTATIONS_MAX: usize = 256 * 1024;

/// The largest request etcd takes by default (`--max-request-bytes`, 1.5 MiB): a larger object
/// cannot be stored at all ("request is too large").
pub const ETCD_REQUEST_MAX: usize = 1536 * 1024;

/// The length of `value`'s JSON encoding (as `serde_json::to_vec` writes it), counted
/// without writing it anywhere: a 20,000-address tier measured on every pass would otherwise
/// be a copy of its whole encoding each time. None when it does not serialize.
pub fn json_len(value: &impl serde::Serialize) -> Option<usize> {
    /// Counts the bytes written to it.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).ok()?;
    Some(count.0)
}

/// What storing an object of `bytes` (its JSON encoding) runs into, if anything.
pub fn size_warning(bytes: usize) -> Option<String> {
    if bytes > ETCD_REQUEST_MAX {
        Some(format!(
            "{bytes} bytes as JSON: too large to store (etcd takes at most {ETCD_REQUEST_MAX} bytes per request by default): move the addresses into AddressSets (at most 1000 each, docs/intent.md), referenced from a set with fromAddressSets: true"
        ))
    } else if bytes > ANNOTATIONS_MAX {
        Some(format!(
            "{bytes} bytes as JSON: `kubectl apply` will fail (its last-applied annotation may hold at most {ANNOTATIONS_MAX} bytes): use `kubectl apply --server-side` or `kubectl create`, or move the addresses into AddressSets (docs/intent.md)"
        ))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_counted_is_the_length_written() {
        let v = serde_json::json!({"a": ["10.0.0.1", "é\"x", 1.5, null], "b": {"c": true}});
        assert_eq!(json_len(&v), Some(serde_json::to_vec(&v).unwrap().len()));
    }

    #[test]
    fn the_two_limits_are_named_where_they_bite() {
        assert_eq!(size_warning(ANNOTATIONS_MAX), None);
        let apply = size_warning(ANNOTATIONS_MAX + 1).unwrap();
        assert!(
            apply.contains("kubectl apply") && apply.contains("--server-side"),
            "{apply}"
        );
        assert!(!apply.contains("too large to store"), "{apply}");
        let store = size_warning(ETCD_REQUEST_MAX + 1).unwrap();
        assert!(
            store.contains("too large to store") && store.contains("AddressSets"),
            "{store}"
        );
    }
}
