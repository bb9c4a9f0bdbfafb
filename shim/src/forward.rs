//! The ttrpc client to the runc shim. Requests are sent raw, with the service
//! name of the task API that shim serves (v2 or v3: same messages), so one
//! client fronts containerd 1.6, 1.7 and 2.x runc shims alike. The runc shim's
//! error statuses are passed back to containerd untouched: containerd maps their
//! codes (NotFound, FailedPrecondition, …) to its own error kinds.

use containerd_shim::protos::protobuf::{CodedInputStream, Message};
use containerd_shim::protos::ttrpc::{self, context, r#async::Client, Code, Request, Status};

use crate::inner::{Endpoint, TaskApi};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("cannot connect to the runc shim at {address}: {source}")]
    Connect {
        address: String,
        source: ttrpc::Error,
    },
}

#[derive(Clone)]
pub struct Forwarder {
    client: Client,
    api: TaskApi,
    address: String,
}

impl Forwarder {
    pub async fn connect(endpoint: &Endpoint) -> Result<Forwarder, ForwardError> {
        let client =
            Client::connect(&endpoint.address)
                .await
                .map_err(|source| ForwardError::Connect {
                    address: endpoint.address.clone(),
                    source,
                })?;
        Ok(Forwarder {
            client,
            api: endpoint.api,
            address: endpoint.address.clone(),
        })
    }

    /// One unary call. `ctx` is containerd's: its metadata (namespace) and
    /// deadline go along.
    pub async fn call<Req: Message, Resp: Message>(
        &self,
        ctx: &context::Context,
        method: &str,
        request: &Req,
    ) -> ttrpc::Result<Resp> {
        self.call_raw(ctx, method, request)
            .await
            .map_err(|e| self.to_status(method, e))
    }

    /// Like `call`, but says what is known of a failure: whether the runc shim
    /// answered it (`Answered`), or the request may or may not have been carried
    /// out (`NoAnswer`: a deadline, a broken connection, an unreadable answer).
    pub async fn call_raw<Req: Message, Resp: Message>(
        &self,
        ctx: &context::Context,
        method: &str,
        request: &Req,
    ) -> Result<Resp, CallError> {
        let payload = request.write_to_bytes().map_err(|e| {
            CallError::NotSent(ttrpc::Error::Others(format!("encode {method}: {e}")))
        })?;
        let request = Request {
            service: self.api.service().to_owned(),
            method: method.to_owned(),
            timeout_nano: ctx.timeout_nano,
            metadata: context::to_pb(ctx.metadata.clone()),
            payload,
            ..Default::default()
        };
        let response = self.client.request(request).await.map_err(|e| match e {
            ttrpc::Error::RpcStatus(status) => CallError::Answered(status),
            // A timeout on this side, a closed or broken connection: the
            // request may have reached the runc shim and been carried out.
            other => CallError::NoAnswer(other),
        })?;
        let mut input = CodedInputStream::from_bytes(&response.payload);
        let mut answer = Resp::new();
        answer.merge_from(&mut input).map_err(|e| {
            // It answered OK: whatever it did was done.
            CallError::NoAnswer(ttrpc::Error::Others(format!("decode {method} answer: {e}")))
        })?;
        Ok(answer)
    }

    /// A status from the runc shim passes through; a broken connection becomes
    /// UNAVAILABLE naming the runc shim, so the failure is traceable.
    pub fn to_status(&self, method: &str, error: CallError) -> ttrpc::Error {
        match error {
            CallError::Answered(status) => ttrpc::Error::RpcStatus(status),
            CallError::NotSent(e) => e,
            CallError::NoAnswer(other) => ttrpc::Error::RpcStatus(ttrpc::get_status(
                Code::UNAVAILABLE,
                format!(
                    "gpushare: runc shim at {} ({method}): {other}",
                    self.address
                ),
            )),
        }
    }
}

/// How a call to the runc shim failed, as far as this shim can know.
#[derive(Debug, Clone)]
pub enum CallError {
    /// It never left this shim (it could not be encoded): nothing happened.
    NotSent(ttrpc::Error),
    /// The runc shim answered with this error status.
    Answered(Status),
    /// Sent, and no answer that could be read: a deadline passed on this side,
    /// the connection closed or broke, or the answer was garbled.
    NoAnswer(ttrpc::Error),
}

#[cfg(test)]
impl CallError {
    pub fn answered(code: Code, message: &str) -> CallError {
        CallError::Answered(ttrpc::get_status(code, message))
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::NotSent(e) => write!(f, "not sent: {e}"),
            CallError::Answered(s) => write!(f, "{:?}: {}", s.code(), s.message),
            CallError::NoAnswer(e) => write!(f, "no answer: {e}"),
        }
    }
}

/// The incoming call's context, for passing on.
pub fn context_of(ctx: &ttrpc::r#async::TtrpcContext) -> context::Context {
    context::Context {
        metadata: ctx.metadata.clone(),
        timeout_nano: ctx.timeout_nano,
    }
}

pub fn is_not_found(error: &ttrpc::Error) -> bool {
    matches!(error, ttrpc::Error::RpcStatus(s) if s.code() == Code::NOT_FOUND)
}
