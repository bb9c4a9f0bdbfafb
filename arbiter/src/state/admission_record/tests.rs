use super::*;

#[test]
fn each_count_goes_to_its_own_figure() {
    let mut record = AdmissionRecord::default();
    record.placement_decided(Duration::from_micros(20));
    record.batch_searched(Duration::from_millis(3));
    record.batch_searched(Duration::from_millis(1));
    record.waited_for_fragmented_memory();
    record.timed_out(Priority::High);
    record.timed_out(Priority::Low);
    record.timed_out(Priority::Low);
    let times = record.placement_times();
    assert_eq!(times.decisions.count, 1);
    assert_eq!(times.batch_searches.count, 2);
    assert_eq!(record.waits_fragmented(), 1);
    assert_eq!(record.rejections().high, 1);
    assert_eq!(record.rejections().low, 2);
}
