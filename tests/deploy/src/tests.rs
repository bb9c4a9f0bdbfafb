use super::*;
use serde_json::json;

fn parse(text: &str) -> Result<Vec<Document>, ManifestError> {
    parse_documents(Path::new("test.yaml"), text)
}

const POD: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: p
  annotations:
    gpushare.io/priority: high
spec:
  runtimeClassName: gpushare
  containers:
    - name: c
      image: busybox
      ports:
        - containerPort: 80
      resources:
        limits:
          gpushare.io/memory: 4
          cpu: 0.5
"#;

#[test]
fn a_correct_pod_passes_with_its_quantities_written_as_numbers() {
    let documents = parse(POD).unwrap();
    let [Document {
        object: Object::Pod(pod),
        ..
    }] = &documents[..]
    else {
        panic!("{documents:?}");
    };
    let limits = pod.spec.as_ref().unwrap().containers[0]
        .resources
        .as_ref()
        .unwrap()
        .limits
        .as_ref()
        .unwrap();
    assert_eq!(limits["gpushare.io/memory"].0, "4");
    assert_eq!(limits["cpu"].0, "0.5");
}

#[test]
fn a_misspelt_field_fails_naming_file_document_and_path() {
    let cases = [
        ("resources:", "resource:", "spec.containers[0].resource"),
        ("containers:", "contianers:", "spec.contianers"),
        (
            "runtimeClassName:",
            "runtimeclassName:",
            "spec.runtimeclassName",
        ),
        ("limits:", "limit:", "spec.containers[0].resources.limit"),
        (
            "containerPort:",
            "containerport:",
            "spec.containers[0].ports[0].containerport",
        ),
        ("  annotations:", "  anotations:", "metadata.anotations"),
    ];
    for (right, wrong, path) in cases {
        let text = format!("{POD}---\n{}", POD.replacen(right, wrong, 1));
        let message = parse(&text).unwrap_err().to_string();
        assert!(
            message.starts_with("test.yaml, document 2: Pod field ")
                && message.contains(&format!(" {path} is not a field there")),
            "{wrong}: {message}"
        );
    }
}

#[test]
fn unknown_kinds_wrong_api_versions_and_bad_values_are_refused() {
    let cases = [
        (
            "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n",
            "kind \"Secret\" is not checked here",
        ),
        ("apiVersion: v1\nmetadata: {name: s}\n", "no string `kind`"),
        (
            "apiVersion: apps/v1\nkind: Pod\nmetadata: {name: p}\n",
            "apiVersion \"apps/v1\" for kind Pod: expected \"v1\"",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: 3}\n",
            "not a valid Pod",
        ),
        // An annotation must be a string: kube-apiserver refuses `true` there.
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, annotations: {a: true}}\n",
            "not a valid Pod",
        ),
    ];
    for (text, expected) in cases {
        let message = parse(text).unwrap_err().to_string();
        assert!(message.contains(expected), "{text}: {message}");
    }
}

#[test]
fn comment_only_documents_are_skipped() {
    let documents = parse(&format!("{POD}---\n# nothing\n---\n{POD}---\n# trailing\n")).unwrap();
    let numbers: Vec<usize> = documents.iter().map(|d| d.source.document).collect();
    assert_eq!(numbers, [1, 3]);
}

#[test]
fn lost_fields_allows_what_k8s_openapi_legitimately_changes() {
    let cases = [
        // (written, typed, lost paths)
        (json!({"a": null}), json!({}), vec![]),
        (json!({"a": {}, "b": []}), json!({}), vec![]),
        (
            json!({"q": 4, "b": true}),
            json!({"q": "4", "b": "true"}),
            vec![],
        ),
        (json!({"a": 1}), json!({"a": 1, "kind": "Pod"}), vec![]),
        (json!({"a": 1}), json!({}), vec!["a"]),
        (
            json!({"a": {"b": [{"c": 1, "d": 2}]}}),
            json!({"a": {"b": [{"c": 1}]}}),
            vec!["a.b[0].d"],
        ),
        (
            json!({"m": {"x.io/y": "1"}}),
            json!({"m": {}}),
            vec!["m[\"x.io/y\"]"],
        ),
        (json!({"a": [1, 2]}), json!({"a": [1]}), vec!["a"]),
        (json!({"a": "4"}), json!({"a": 4}), vec!["a"]),
        (json!({"a": 5}), json!({"a": "4"}), vec!["a"]),
    ];
    for (written, typed, expected) in cases {
        let lost: Vec<String> = lost_fields(&written, &typed)
            .into_iter()
            .map(|(path, _)| path)
            .collect();
        assert_eq!(lost, expected, "{written} -> {typed}");
    }
}

#[test]
fn annotation_patterns_follow_go_path_match() {
    let cases = [
        ("gpushare.io/*", "gpushare.io/memory", Some(true)),
        ("gpushare.io/*", "grant.gpushare.io/id", Some(false)),
        ("grant.gpushare.io/*", "grant.gpushare.io/id", Some(true)),
        ("*", "grant.gpushare.io/id", Some(false)),
        ("*/*", "grant.gpushare.io/id", Some(true)),
        ("*.gpushare.io/*", "grant.gpushare.io/high", Some(true)),
        ("gpushare.io/?d", "gpushare.io/id", Some(true)),
        ("gpushare.io/?", "gpushare.io/", Some(false)),
        ("gpushare.io/[a-z]*", "gpushare.io/id", None),
    ];
    for (pattern, key, expected) in cases {
        assert_eq!(
            annotation_pattern_matches(pattern, key),
            expected,
            "{pattern} {key}"
        );
    }
}
