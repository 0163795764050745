use serde::Deserialize;

use super::*;

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Rule {
    name: String,
    action: Action,
}

#[derive(Deserialize, Debug)]
#[serde(rename_all = "lowercase")]
enum Action {
    Accept,
    Drop,
}

#[derive(Deserialize, Debug)]
#[allow(dead_code)]
struct Chain {
    rules: Vec<Rule>,
}

const TEXT: &str = "# a comment\nrules:\n- name: a\n  action: accept\n---\nrules:\n- name: b\n  action: dorp\n- name: c\n  action: accept\n- name: d\n  acton: drop\n- {name: e, action: nope}\n";

fn key(k: &str) -> Seg {
    Seg::Key(k.into())
}

#[test]
fn a_path_is_found_at_its_line_in_any_document() {
    assert_eq!(
        line_of(TEXT, 0, &[key("rules"), Seg::Index(0), key("action")]),
        Some(4)
    );
    assert_eq!(
        line_of(TEXT, 1, &[key("rules"), Seg::Index(0), key("action")]),
        Some(8)
    );
    assert_eq!(
        line_of(TEXT, 1, &[key("rules"), Seg::Index(2), key("acton")]),
        Some(12)
    );
    assert_eq!(
        line_of(TEXT, 1, &[key("rules"), Seg::Index(3), key("action")]),
        Some(13)
    );
    // A path that is not there: the nearest node above it that is.
    assert_eq!(
        line_of(TEXT, 1, &[key("rules"), Seg::Index(2), key("action")]),
        Some(11)
    );
    assert_eq!(line_of(TEXT, 5, &[]), None);
}

#[test]
fn every_broken_element_is_named_by_its_index_in_the_file() {
    let doc = serde_yaml::Deserializer::from_str(TEXT).nth(1).unwrap();
    let value = serde_yaml::Value::deserialize(doc).unwrap();
    let errors = field_errors::<Chain>(&value, |m| m.to_string());
    let shown: Vec<&str> = errors.iter().map(|e| e.shown.as_str()).collect();
    // Element 1 (c) is fine; 0, 2 and 3 are not, named as in the file although each was
    // taken out before the next was found.
    assert_eq!(
        shown,
        ["rules[0].action", "rules[2].acton", "rules[3].action"]
    );
    assert!(
        errors[0].message.contains("unknown variant `dorp`"),
        "{errors:?}"
    );
    assert!(
        errors[1].message.contains("unknown field `acton`"),
        "{errors:?}"
    );
    assert!(
        errors[2].message.contains("unknown variant `nope`"),
        "{errors:?}"
    );
    let good = serde_yaml::Deserializer::from_str(TEXT).next().unwrap();
    let good = serde_yaml::Value::deserialize(good).unwrap();
    assert!(field_errors::<Chain>(&good, |m| m.to_string()).is_empty());
}

#[test]
fn indices_taken_out_map_back_to_the_file() {
    let taken = vec![(vec![key("rules")], vec![0, 2])];
    // The element now first was the file's second; now second, the file's fourth.
    assert_eq!(
        original(&[key("rules"), Seg::Index(0), key("x")], &taken),
        [key("rules"), Seg::Index(1), key("x")]
    );
    assert_eq!(
        original(&[key("rules"), Seg::Index(1)], &taken),
        [key("rules"), Seg::Index(3)]
    );
    // Another list is not shifted.
    assert_eq!(
        original(&[key("other"), Seg::Index(0)], &taken),
        [key("other"), Seg::Index(0)]
    );
}

#[test]
fn at_most_max_errors_are_listed() {
    let mut text = String::from("rules:\n");
    for i in 0..(MAX_ERRORS + 5) {
        text.push_str(&format!("- {{name: r{i}, action: bad}}\n"));
    }
    let value: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(
        field_errors::<Chain>(&value, |m| m.to_string()).len(),
        MAX_ERRORS
    );
}
