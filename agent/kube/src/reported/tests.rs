use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ObjectMeta;

use super::status_only;
use crate::Changes;

fn meta() -> ObjectMeta {
    ObjectMeta {
        name: Some("gateway".into()),
        namespace: Some("liqo-tenant-a".into()),
        uid: Some("u1".into()),
        generation: Some(3),
        resource_version: Some("10".into()),
        labels: Some(BTreeMap::from([("a".into(), "b".into())])),
        ..Default::default()
    }
}

#[test]
fn a_new_resource_version_alone_is_status_only() {
    let new = ObjectMeta {
        resource_version: Some("11".into()),
        managed_fields: Some(vec![Default::default()]),
        ..meta()
    };
    assert!(status_only(&meta(), &new));
}

#[test]
fn anything_the_controller_reads_is_a_change() {
    let changes: Vec<(&str, ObjectMeta)> = vec![
        (
            "generation",
            ObjectMeta {
                generation: Some(4),
                ..meta()
            },
        ),
        (
            "uid (deleted and created again)",
            ObjectMeta {
                uid: Some("u2".into()),
                ..meta()
            },
        ),
        (
            "labels",
            ObjectMeta {
                labels: None,
                ..meta()
            },
        ),
        (
            "annotations",
            ObjectMeta {
                annotations: Some(BTreeMap::from([("x".into(), "y".into())])),
                ..meta()
            },
        ),
        (
            "finalizers",
            ObjectMeta {
                finalizers: Some(vec!["f".into()]),
                ..meta()
            },
        ),
        (
            "owners",
            ObjectMeta {
                owner_references: Some(vec![Default::default()]),
                ..meta()
            },
        ),
        (
            "deletion",
            ObjectMeta {
                deletion_timestamp: Some(Time(Default::default())),
                ..meta()
            },
        ),
    ];
    for (what, new) in changes {
        assert!(!status_only(&meta(), &new), "{what}");
    }
}

#[test]
fn without_a_generation_every_event_is_a_change() {
    let old = ObjectMeta {
        generation: None,
        ..meta()
    };
    assert!(!status_only(&old, &old.clone()));
    let old = ObjectMeta {
        uid: None,
        ..meta()
    };
    assert!(!status_only(&old, &old.clone()));
}

#[test]
fn the_controllers_own_outputs_move_the_count_and_not_the_inputs() {
    let c = Changes::default();
    c.bump();
    assert_eq!((c.count(), c.inputs()), (1, 1), "a pod, a policy: both");
    c.bump_output();
    assert_eq!(
        (c.count(), c.inputs()),
        (2, 1),
        "its own configuration echoed"
    );
    c.reported(true);
    assert_eq!((c.count(), c.inputs()), (2, 1), "a host's report: neither");
}
