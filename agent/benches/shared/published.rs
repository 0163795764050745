//! What the controller published: the addresses of the `offloaded` sets over every AddressSet
//! slice, in one tenant namespace or all (`bench-control`, `bench-peers`).

use kube::api::{Api, DynamicObject};
use kube::Client;

/// Addresses of the `offloaded` sets over the slices in `namespace` (None: every namespace).
pub async fn offloaded(client: &Client, namespace: Option<&str>) -> usize {
    let resource = peerwall::k8s::address_set_resource();
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let Ok(list) = api.list(&Default::default()).await else {
        return 0;
    };
    list.items
        .iter()
        .filter(|o| o.data["spec"]["set"] == "offloaded")
        .map(|o| o.data["spec"]["addresses"].as_array().map_or(0, Vec::len))
        .sum()
}
