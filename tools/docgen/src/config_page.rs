//! gpushare.toml(5): the configuration file's reference, generated from the typed
//! configuration so it cannot drift from it. Each key's type and description come from
//! `gpushare_config::Config`'s JSON Schema (schemars: the fields' doc comments), its
//! default from `Config::default()`, and how a change to it takes effect from the
//! arbiter's reload table (`gpushare_arbiter::daemon::effect`).
//!
//! Reading the schema into [`Key`]s is pure and tested here; rendering them is roff.

use clap_mangen::roff::{bold, italic, roman, Roff};
use gpushare_arbiter::daemon::Effect;
use gpushare_config::Config;
use serde_json::{Map, Value};

use crate::manual::{Entry, Example, Section};
use crate::page;

/// The page's name: the configuration file is TOML, read by every gpushare program.
pub const PAGE: &str = "gpushare.toml";

/// One key of the file, as the page states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// Dotted, as check-config and the reload log name it (`scheduler.slice_ms`);
    /// a key inside each table of a list, `arbiter.devices[].uuid`; inside each
    /// entry of a named table, `runtime.profiles.NAME.priority`.
    pub key: String,
    /// What value it takes (`integer`, `one of: priority, round-robin, off`).
    pub kind: String,
    /// The default as TOML writes it; `None`: unset by default (or required inside
    /// its table, which `required` says).
    pub default: Option<String>,
    pub required: bool,
    /// The doc comment of the field.
    pub description: String,
    /// What the values of an enumeration mean, each with its doc comment.
    pub values: Vec<(String, String)>,
    /// The forms a quantity accepts (`512Mi`, `25%`), as its parser's errors say them.
    pub accepted: Option<String>,
}

/// One table of the file (`[scheduler]`) and its keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub name: String,
    pub description: String,
    pub keys: Vec<Key>,
}

/// The configuration's schema, as JSON.
pub fn schema() -> Value {
    schemars::schema_for!(Config).to_value()
}

/// Every table of the file and its keys, in the order of the types' fields.
/// `defaults`: `gpushare_config::keys::settings` of the default configuration.
pub fn tables(
    schema: &Value,
    defaults: &std::collections::BTreeMap<String, toml::Value>,
) -> Result<Vec<Table>, String> {
    let defs = schema
        .get("$defs")
        .and_then(Value::as_object)
        .ok_or("the schema has no $defs")?;
    let reader = Reader { defs };
    let mut tables = Vec::new();
    for (section, property) in properties(schema)? {
        let table = reader.resolve(property);
        let mut keys = Vec::new();
        let required = required_fields(table);
        for (field, property) in properties(table)? {
            let key = format!("{section}.{field}");
            let default = defaults.get(&key).map(toml_text);
            reader.add_keys(
                &key,
                property,
                default,
                required.contains(&field),
                &mut keys,
            );
        }
        tables.push(Table {
            name: section.clone(),
            description: text_of(table),
            keys,
        });
    }
    Ok(tables)
}

struct Reader<'a> {
    defs: &'a Map<String, Value>,
}

impl Reader<'_> {
    /// A `$ref`'s definition, or the schema itself.
    fn resolve<'v>(&'v self, schema: &'v Value) -> &'v Value {
        schema
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix("#/$defs/"))
            .and_then(|name| self.defs.get(name))
            .unwrap_or(schema)
    }

    /// The non-null alternative of an optional value (`anyOf: [T, null]`).
    fn unwrap_optional<'v>(&'v self, schema: &'v Value) -> &'v Value {
        match schema.get("anyOf").and_then(Value::as_array) {
            Some(choices) => choices
                .iter()
                .find(|choice| choice.get("type").and_then(Value::as_str) != Some("null"))
                .unwrap_or(schema),
            None => schema,
        }
    }

    /// `key`, and the keys inside it when its value is a list of tables or a table
    /// of named tables.
    fn add_keys(
        &self,
        key: &str,
        property: &Value,
        default: Option<String>,
        required: bool,
        keys: &mut Vec<Key>,
    ) {
        let value = self.resolve(self.unwrap_optional(property));
        let default = default.or_else(|| property.get("default").map(json_text));
        let (values, kind) = self.kind(property);
        keys.push(Key {
            key: key.to_owned(),
            kind,
            default: default.filter(|_| !required),
            required,
            description: match text_of(property) {
                own if own.is_empty() => text_of(value),
                own => own,
            },
            values,
            accepted: value
                .get("x-accepted")
                .and_then(Value::as_str)
                .map(str::to_owned),
        });
        let (inner, prefix) = if let Some(items) = value.get("items") {
            (self.resolve(items), format!("{key}[]"))
        } else if let Some(entries) = value.get("additionalProperties").filter(|v| v.is_object()) {
            (self.resolve(entries), format!("{key}.NAME"))
        } else {
            return;
        };
        let Ok(fields) = properties(inner) else {
            return;
        };
        let required = required_fields(inner);
        for (field, property) in fields {
            self.add_keys(
                &format!("{prefix}.{field}"),
                property,
                None,
                required.contains(&field),
                keys,
            );
        }
    }

    /// What a value is, in words, and the values of an enumeration with their meaning.
    fn kind(&self, property: &Value) -> (Vec<(String, String)>, String) {
        let value = self.resolve(self.unwrap_optional(property));
        let mut values = Vec::new();
        // gpushare's own formats (crate gpushare_config's schema module); schemars's
        // (uint64, double) say no more than the type does.
        let format = match value.get("format").and_then(Value::as_str) {
            Some("size") => Some("size in bytes"),
            Some("memory") => Some("memory amount"),
            Some("fraction") => Some("fraction"),
            _ => None,
        };
        let kind = if let Some(format) = format {
            format.to_owned()
        } else if let Some(choices) = value.get("oneOf").and_then(Value::as_array) {
            for choice in choices {
                let name = choice
                    .get("const")
                    .or_else(|| choice.get("enum").and_then(|e| e.get(0)))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                values.push((name.to_owned(), text_of(choice)));
            }
            one_of(values.iter().map(|(name, _)| name.as_str()))
        } else if let Some(names) = value.get("enum").and_then(Value::as_array) {
            one_of(names.iter().filter_map(Value::as_str))
        } else {
            match type_name(value) {
                Some("array") => {
                    let items = value.get("items").map(|items| self.resolve(items));
                    match items.map(|items| self.kind(items).1).as_deref() {
                        Some("table") => "list of tables".to_owned(),
                        Some(item) => format!("list of {item}s"),
                        None => "list".to_owned(),
                    }
                }
                Some("object")
                    if value
                        .get("additionalProperties")
                        .is_some_and(Value::is_object) =>
                {
                    "table of named tables".to_owned()
                }
                Some("object") => "table".to_owned(),
                Some(other) => other.to_owned(),
                None => "value".to_owned(),
            }
        };
        (values, kind)
    }
}

/// A schema's `type`, the first that is not null.
fn type_name(schema: &Value) -> Option<&str> {
    match schema.get("type")? {
        Value::String(name) => Some(name),
        Value::Array(names) => names
            .iter()
            .filter_map(Value::as_str)
            .find(|n| *n != "null"),
        _ => None,
    }
}

fn one_of<'a>(names: impl Iterator<Item = &'a str>) -> String {
    format!("one of: {}", names.collect::<Vec<_>>().join(", "))
}

fn properties(schema: &Value) -> Result<Vec<(String, &Value)>, String> {
    Ok(schema
        .get("properties")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("no properties in {schema}"))?
        .iter()
        .map(|(name, value)| (name.clone(), value))
        .collect())
}

fn required_fields(schema: &Value) -> Vec<String> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|names| {
            names
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// A doc comment as schemars keeps it: a one-line first paragraph as `title`, the
/// rest as `description`. Line breaks inside a paragraph are the source's wrapping;
/// the Markdown code quotes are left out, which a man page does not use.
fn text_of(schema: &Value) -> String {
    let part = |name| schema.get(name).and_then(Value::as_str).unwrap_or_default();
    let whole = [part("title"), part("description")]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n");
    whole
        .split("\n\n")
        .map(|paragraph| {
            paragraph
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .replace('`', "")
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn toml_text(value: &toml::Value) -> String {
    match value {
        toml::Value::Integer(n) => size_hint(*n),
        other => other.to_string(),
    }
}

fn json_text(value: &Value) -> String {
    match value {
        Value::Number(n) => n.as_i64().map(size_hint).unwrap_or_else(|| n.to_string()),
        other => other.to_string(),
    }
}

/// A default that is a whole number of MiB or GiB of bytes is also said in those
/// units (`314572800 (300Mi)`): written as a plain integer it reads as a count.
fn size_hint(n: i64) -> String {
    const MI: i64 = 1 << 20;
    const GI: i64 = 1 << 30;
    match n {
        n if n >= GI && n % GI == 0 => format!("{n} ({}Gi)", n / GI),
        n if n >= MI && n % MI == 0 => format!("{n} ({}Mi)", n / MI),
        n => n.to_string(),
    }
}

/// How a change to `key` takes effect, for the page. A key inside a list or a
/// named table is its outer key's.
pub fn takes_effect(key: &str) -> String {
    let outer: String = key.split('.').take(2).collect::<Vec<_>>().join(".");
    let outer = outer.trim_end_matches("[]");
    match gpushare_arbiter::daemon::effect(outer) {
        Effect::Applied => {
            "A reload applies it (SIGHUP: systemctl reload gpushare-arbiter).".to_owned()
        }
        Effect::ReadAtEachUse => "Read at each use (container start, gpusharectl): \
             in effect from the next one, no reload needed."
            .to_owned(),
        Effect::NeedsRestart(daemon) => format!(
            "Needs a restart of {daemon}: a reload keeps the running value and names the key \
             in the log."
        ),
    }
}

/// A file that sets a few keys, shown as the page's example; a test parses it.
pub const EXAMPLE: &str = r#"[arbiter]
default_memory = "25%"
metrics_address = "127.0.0.1:9447"

[scheduler]
slice_ms = 20

[runtime.profiles.inference]
priority = "high"
memory = "8Gi"
"#;

/// The page, gpushare.toml.5.
pub fn render(tables: &[Table]) -> Vec<u8> {
    let mut roff = Roff::new();
    let source = format!("gpushare {}", env!("CARGO_PKG_VERSION"));
    roff.control("TH", [PAGE, "5", "", source.as_str(), "File Formats"]);
    page::name_section(
        &mut roff,
        PAGE,
        Some("gpushare's configuration file".into()),
    );
    roff.control("SH", ["SYNOPSIS"]);
    roff.text([bold(gpushare_config::DEFAULT_PATH)]);
    roff.control("SH", ["DESCRIPTION"]);
    page::paragraphs(
        &mut roff,
        "Every gpushare program reads this one TOML file, or the file $GPUSHARE_CONFIG or \
         their --config option names: gpushare-arbiter at its start and at each SIGHUP; \
         gpushare-runc, gpushare-hook and the containerd shim at each container start; \
         gpusharectl and gpushare-kube at their start. Every key has a default, so a node \
         works with no file at all. An unknown key or a value of the wrong type is an \
         error that names the key and the file, never a silent default: check a file with \
         gpushare-arbiter check-config FILE before saving it where the programs read it.\n\n\
         Keys are named here as check-config and the arbiter's log name them: \
         scheduler.slice_ms is slice_ms in the [scheduler] table. A list of tables \
         (arbiter.devices) is written [[arbiter.devices]], its keys listed as \
         arbiter.devices[].uuid; a table of named tables (runtime.profiles) is written \
         [runtime.profiles.NAME]. PREFIX in a default is where the programs are \
         installed: /usr/local by make install, /usr by the Debian package.\n\n\
         Each key says how a change to it takes effect: applied by a reload of \
         gpushare-arbiter (SIGHUP), read at each use, or only at a restart.",
    );
    for table in tables {
        roff.control("SH", [format!("[{}]", table.name).as_str()]);
        if !table.description.is_empty() {
            page::paragraphs(&mut roff, &table.description);
        }
        for key in &table.keys {
            key_entry(&mut roff, key);
        }
    }
    page::section(
        &mut roff,
        "FILES",
        &Section::Entries(&[
            Entry {
                term: gpushare_config::DEFAULT_PATH,
                text: "The file, when neither --config nor $GPUSHARE_CONFIG names another. \
                       make install and the Debian package install it only where there is \
                       none.",
            },
            Entry {
                term: "PREFIX/share/gpushare/config.toml.default",
                text: "The file as this installation shipped it: the defaults, with a comment \
                       per key; uninstalling removes config.toml only while it still equals it.",
            },
        ]),
    );
    page::section(
        &mut roff,
        "ENVIRONMENT",
        &Section::Entries(&[Entry {
            term: gpushare_config::PATH_ENV,
            text: "The file every program reads instead, when its --config names none; read \
                   from the environment of the program (dockerd, containerd, the arbiter's \
                   unit), never from a container's.",
        }]),
    );
    page::section(
        &mut roff,
        "SIGNALS",
        &Section::Entries(&[Entry {
            term: "SIGHUP",
            text: "Sent to gpushare-arbiter (systemctl reload gpushare-arbiter), makes it read \
                   the file again: each key's entry above says whether that applies a change.",
        }]),
    );
    roff.control("SH", ["EXAMPLES"]);
    roff.text([roman(
        "Expose the metrics on loopback, give containers that name no amount a quarter of a \
         GPU's memory, keep 20 ms slices, and define a runtime profile for docker's runtime \
         gpushare-inference (gpusharectl setup docker --profile inference):",
    )]);
    roff.control("RS", ["4"]);
    roff.control("nf", []);
    for line in EXAMPLE.lines() {
        roff.text([roman(line)]);
    }
    roff.control("fi", []);
    roff.control("RE", []);
    page::example_lines(
        &mut roff,
        &Example {
            command: "gpushare-arbiter check-config /etc/gpushare/config.toml && systemctl reload gpushare-arbiter",
            text: "Check an edited file, then apply it.",
        },
    );
    page::see_also_section(
        &mut roff,
        &[
            "gpushare-arbiter(1)".into(),
            "gpusharectl(1)".into(),
            "gpushare-runc(1)".into(),
            "gpushare-hook(1)".into(),
            "containerd-shim-gpushare-v2(1)".into(),
            "gpushare-kube(1)".into(),
        ],
    );
    roff.render().into_bytes()
}

fn key_entry(roff: &mut Roff, key: &Key) {
    roff.control("TP", []);
    roff.text([bold(key.key.as_str())]);
    let default = match (&key.default, key.required) {
        (_, true) => "required in its table".to_owned(),
        // Such a default is where this very program is installed: the page says so
        // rather than the prefix gpushare-docgen happened to run from.
        (Some(default), false) if key.description.contains("<prefix>") => {
            let prefix = gpushare_config::install_prefix();
            format!(
                "default {}",
                default.replacen(&*prefix.to_string_lossy(), "PREFIX", 1)
            )
        }
        (Some(default), false) => format!("default {default}"),
        (None, false) => "unset by default".to_owned(),
    };
    roff.text([italic(format!("{}; {default}.", key.kind))]);
    if !key.description.is_empty() {
        roff.control("br", []);
        page::paragraphs(roff, &key.description);
    }
    if let Some(accepted) = &key.accepted {
        roff.control("br", []);
        roff.text([roman(format!("Accepted: {accepted}."))]);
    }
    if !key.values.is_empty() {
        roff.control("RS", []);
        for (value, meaning) in &key.values {
            roff.control("TP", []);
            roff.text([bold(value.as_str())]);
            roff.text([roman(meaning.as_str())]);
        }
        roff.control("RE", []);
    }
    roff.control("br", []);
    roff.text([roman(takes_effect(&key.key))]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "scheduler": { "$ref": "#/$defs/Scheduler" }
            },
            "$defs": {
                "Scheduler": {
                    "description": "The `[scheduler]` table.",
                    "type": "object",
                    "properties": {
                        "policy": { "$ref": "#/$defs/Policy", "description": "Which one." },
                        "slice_ms": { "type": "integer", "format": "uint64", "title": "Slice.", "description": "While `others`\n wait." },
                        "memory": { "type": ["string", "null"], "format": "memory", "x-accepted": "512Mi or 25%" },
                        "devices": { "type": "array", "items": { "$ref": "#/$defs/Device" } },
                        "profiles": { "type": "object", "additionalProperties": { "$ref": "#/$defs/Device" } },
                        "names": { "type": "array", "items": { "type": "string" } }
                    }
                },
                "Policy": {
                    "oneOf": [
                        { "const": "priority", "description": "High first." },
                        { "enum": ["off"], "description": "No token." }
                    ]
                },
                "Device": {
                    "type": "object",
                    "properties": {
                        "uuid": { "type": "string", "description": "Its UUID." },
                        "name": { "type": "string", "default": "declared GPU" }
                    },
                    "required": ["uuid"]
                }
            }
        })
    }

    fn key<'a>(tables: &'a [Table], name: &str) -> &'a Key {
        tables[0]
            .keys
            .iter()
            .find(|k| k.key == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    #[test]
    fn keys_carry_kind_default_description_and_values() {
        let defaults = BTreeMap::from([
            ("scheduler.slice_ms".to_owned(), toml::Value::Integer(20)),
            ("scheduler.policy".to_owned(), toml::Value::from("priority")),
        ]);
        let tables = tables(&schema(), &defaults).unwrap();
        assert_eq!(tables.len(), 1);
        assert_eq!(tables[0].name, "scheduler");
        assert_eq!(tables[0].description, "The [scheduler] table.");
        let names: Vec<&str> = tables[0].keys.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(
            names,
            [
                "scheduler.policy",
                "scheduler.slice_ms",
                "scheduler.memory",
                "scheduler.devices",
                "scheduler.devices[].uuid",
                "scheduler.devices[].name",
                "scheduler.profiles",
                "scheduler.profiles.NAME.uuid",
                "scheduler.profiles.NAME.name",
                "scheduler.names",
            ]
        );
        let policy = key(&tables, "scheduler.policy");
        assert_eq!(policy.kind, "one of: priority, off");
        assert_eq!(policy.default.as_deref(), Some("\"priority\""));
        assert_eq!(policy.description, "Which one.");
        assert_eq!(
            policy.values,
            [
                ("priority".to_owned(), "High first.".to_owned()),
                ("off".to_owned(), "No token.".to_owned())
            ]
        );
        let slice = key(&tables, "scheduler.slice_ms");
        assert_eq!(
            (slice.kind.as_str(), slice.default.as_deref()),
            ("integer", Some("20"))
        );
        assert_eq!(slice.description, "Slice.\n\nWhile others wait.");
        let memory = key(&tables, "scheduler.memory");
        assert_eq!(memory.kind, "memory amount");
        assert_eq!(memory.default, None);
        assert_eq!(memory.accepted.as_deref(), Some("512Mi or 25%"));
        assert_eq!(key(&tables, "scheduler.devices").kind, "list of tables");
        assert_eq!(key(&tables, "scheduler.names").kind, "list of strings");
        assert_eq!(
            key(&tables, "scheduler.profiles").kind,
            "table of named tables"
        );
        let uuid = key(&tables, "scheduler.devices[].uuid");
        assert!(uuid.required);
        assert_eq!(uuid.default, None);
        let name = key(&tables, "scheduler.profiles.NAME.name");
        assert!(!name.required);
        assert_eq!(name.default.as_deref(), Some("\"declared GPU\""));
    }

    #[test]
    fn whole_mebibytes_and_gibibytes_are_also_said_in_units() {
        for (n, text) in [
            (20, "20"),
            (300 << 20, "314572800 (300Mi)"),
            (1 << 30, "1073741824 (1Gi)"),
            ((1 << 30) + (1 << 20), "1074790400 (1025Mi)"),
        ] {
            assert_eq!(size_hint(n), text);
        }
    }

    #[test]
    fn a_key_inside_a_list_takes_effect_as_the_list() {
        for (key, effect) in [
            ("arbiter.reservations[].tenant", "A reload applies it"),
            (
                "arbiter.devices[].uuid",
                "Needs a restart of gpushare-arbiter",
            ),
            ("runtime.profiles.NAME.memory", "Read at each use"),
            ("kubernetes.memory_unit", "Needs a restart of gpushare-kube"),
            ("scheduler.slice_ms", "Needs a restart of gpushare-arbiter"),
        ] {
            assert!(
                takes_effect(key).starts_with(effect),
                "{key}: {}",
                takes_effect(key)
            );
        }
    }
}
