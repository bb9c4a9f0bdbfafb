//! Property tests of the decoders both sockets use: arbitrary bytes never panic
//! and never allocate beyond the frame bound; every message round-trips.

use gpushare_proto::frame::{self, read_message, FrameError, MAX_FRAME_BYTES};
use gpushare_proto::{ControlRequest, LeaseId, LeaseRequest, ReserveRequest};
use proptest::prelude::*;

fn lease_request() -> impl Strategy<Value = LeaseRequest> {
    prop_oneof![
        any::<u32>().prop_map(|protocol| LeaseRequest::Hello { protocol }),
        any::<u64>().prop_map(|memory_held| LeaseRequest::Attach { memory_held }),
        Just(LeaseRequest::Query),
        any::<u64>().prop_map(|bytes| LeaseRequest::Charge { bytes }),
        any::<u64>().prop_map(|bytes| LeaseRequest::Credit { bytes }),
    ]
}

fn control_request() -> impl Strategy<Value = ControlRequest> {
    let text = "[ -~]{0,40}";
    prop_oneof![
        any::<u32>().prop_map(|protocol| ControlRequest::Hello { protocol }),
        (text, any::<u32>(), proptest::option::of(text)).prop_map(
            |(container_id, pid, namespace)| ControlRequest::Confirm {
                container_id,
                pid,
                namespace,
                lease: None,
            }
        ),
        text.prop_map(|l| ControlRequest::Release { lease: LeaseId(l) }),
        (text, proptest::option::of(text)).prop_map(|(container_id, l)| {
            ControlRequest::ReleaseContainer {
                container_id,
                namespace: None,
                lease: l.map(LeaseId),
            }
        }),
        (text, text, any::<u32>()).prop_map(|(l, container_id, pid)| ControlRequest::Bind {
            lease: LeaseId(l),
            container_id,
            pid
        }),
        Just(ControlRequest::Status),
        Just(ControlRequest::List),
        (text, any::<bool>()).prop_map(|(gpu, drain)| ControlRequest::Drain { gpu, drain }),
        (text, 0u64..1 << 40, any::<bool>(), 1u32..8).prop_map(|(container_id, bytes, high, n)| {
            ControlRequest::Reserve(ReserveRequest {
                container_id,
                namespace: None,
                sandbox_id: None,
                priority: if high {
                    gpushare_proto::Priority::High
                } else {
                    gpushare_proto::Priority::Low
                },
                memory: (bytes > 0).then_some(gpushare_proto::MemoryRequest::Bytes(bytes)),
                compute_request: gpushare_proto::Fraction::ZERO,
                compute_limit: gpushare_proto::Fraction::ONE,
                gpu: gpushare_proto::GpuSelector::Count(n),
                tenant: None,
                pod: None,
            })
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = read_message::<ControlRequest>(&mut bytes.as_slice());
        let _ = read_message::<LeaseRequest>(&mut bytes.as_slice());
    }

    #[test]
    fn arbitrary_bodies_behind_a_valid_header_are_errors_not_panics(body in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut framed = (body.len() as u32).to_be_bytes().to_vec();
        framed.extend_from_slice(&body);
        let control = read_message::<ControlRequest>(&mut framed.as_slice());
        let lease = read_message::<LeaseRequest>(&mut framed.as_slice());
        if let Err(e) = control { prop_assert!(matches!(e, FrameError::Malformed(_)), "{e}"); }
        if let Err(e) = lease { prop_assert!(matches!(e, FrameError::Malformed(_)), "{e}"); }
    }

    #[test]
    fn oversized_headers_are_refused_before_reading(len in (MAX_FRAME_BYTES as u32 + 1)..=u32::MAX) {
        let header = len.to_be_bytes();
        let err = read_message::<LeaseRequest>(&mut header.as_slice()).unwrap_err();
        let too_large = matches!(err, FrameError::TooLarge { .. });
        prop_assert!(too_large, "{}", err);
    }

    #[test]
    fn lease_requests_round_trip(msg in lease_request()) {
        let bytes = frame::encode(&msg).unwrap();
        prop_assert_eq!(read_message::<LeaseRequest>(&mut bytes.as_slice()).unwrap(), msg);
    }

    #[test]
    fn control_requests_round_trip(msg in control_request()) {
        let bytes = frame::encode(&msg).unwrap();
        prop_assert_eq!(read_message::<ControlRequest>(&mut bytes.as_slice()).unwrap(), msg);
    }

    #[test]
    fn a_truncated_valid_frame_is_an_error(msg in lease_request(), cut in 0usize..64) {
        let bytes = frame::encode(&msg).unwrap();
        let cut = cut.min(bytes.len() - 1);
        prop_assert!(read_message::<LeaseRequest>(&mut &bytes[..cut]).is_err());
    }
}
