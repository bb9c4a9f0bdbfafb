//! The JSON Schema of the values whose types live in gpushare-types, which has no
//! schema of its own: each is written as TOML takes it (a string with a unit, a word),
//! with the forms its parser accepts under `x-accepted`, so the configuration's
//! reference page (gpushare.toml(5)) states them as the error messages do.

use gpushare_types::quantity::{BYTES_FORMS, FRACTION_FORMS, MEMORY_FORMS, PRIORITY_FORMS};
use schemars::{json_schema, Schema, SchemaGenerator};

pub(crate) fn byte_size(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": ["string", "integer"], "format": "size", "x-accepted": BYTES_FORMS })
}

pub(crate) fn memory_request(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": ["string", "number"], "format": "memory", "x-accepted": MEMORY_FORMS })
}

pub(crate) fn fraction(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": ["string", "number"], "format": "fraction", "x-accepted": FRACTION_FORMS })
}

pub(crate) fn priority(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "enum": ["high", "low"], "x-accepted": PRIORITY_FORMS })
}

/// `gpushare_types::LossPolicy`, as its serde attributes name it.
pub(crate) fn loss_policy(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "string",
        "oneOf": [
            { "const": "run", "description": "Submit ungated until the arbiter is back." },
            { "const": "wait", "description": "Submit nothing until the arbiter is back (and grants the token)." }
        ]
    })
}
