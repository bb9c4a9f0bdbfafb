//! Device memory holds what was written to it: host copies, device-to-device copies and
//! memsets, through `libcuda.so.1` in this test process, read back with `cuMemcpyDtoH`.

mod common;
use common::{Lib, Sim, P1, P2, P3, P4, P5};
use libc::{c_int, c_uint, c_void};
use std::sync::OnceLock;

const SUCCESS: c_int = 0;

fn sim() -> &'static Sim {
    static SIM: OnceLock<Sim> = OnceLock::new();
    SIM.get_or_init(|| Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_MEMORY", "16Gi")]))
}

/// The installed driver in this process, with a current context on device 0.
fn lib() -> &'static Lib {
    static LIB: OnceLock<Lib> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = Lib::open(sim());
        let mut ctx = 0usize;
        // SAFETY: cuInit with its only valid flags; a live out-pointer; device 0 exists.
        unsafe {
            assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), SUCCESS);
            assert_eq!(
                lib.f::<P2<*mut usize, c_int>>("cuDevicePrimaryCtxRetain")(&mut ctx, 0),
                SUCCESS
            );
        }
        lib
    })
}

/// Makes the primary context current on the calling thread (tests run on their own threads).
fn current() -> &'static Lib {
    let lib = lib();
    let mut ctx = 0usize;
    // SAFETY: a live out-pointer; device 0 exists.
    unsafe {
        assert_eq!(
            lib.f::<P2<*mut usize, c_int>>("cuDevicePrimaryCtxRetain")(&mut ctx, 0),
            SUCCESS
        );
        assert_eq!(lib.f::<P1<usize>>("cuCtxSetCurrent")(ctx), SUCCESS);
    }
    lib
}

fn alloc(lib: &Lib, bytes: usize) -> u64 {
    let mut ptr = 0u64;
    // SAFETY: a live out-pointer.
    let rc = unsafe { lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut ptr, bytes) };
    assert_eq!(rc, SUCCESS, "cuMemAlloc_v2 of {bytes}");
    ptr
}

fn write(lib: &Lib, name: &str, dst: u64, data: &[u8]) {
    // SAFETY: `data` holds the bytes copied; `dst` is device memory of the test's.
    let rc = unsafe {
        if name.contains("Async") {
            lib.f::<P4<u64, *const c_void, usize, usize>>(name)(
                dst,
                data.as_ptr().cast(),
                data.len(),
                0,
            )
        } else {
            lib.f::<P3<u64, *const c_void, usize>>(name)(dst, data.as_ptr().cast(), data.len())
        }
    };
    assert_eq!(rc, SUCCESS, "{name}");
}

fn read_with(lib: &Lib, name: &str, src: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xa5u8; len];
    // SAFETY: `buf` has room for the bytes copied; `src` is device memory of the test's.
    let rc = unsafe {
        if name.contains("Async") {
            lib.f::<P4<*mut c_void, u64, usize, usize>>(name)(buf.as_mut_ptr().cast(), src, len, 0)
        } else {
            lib.f::<P3<*mut c_void, u64, usize>>(name)(buf.as_mut_ptr().cast(), src, len)
        }
    };
    assert_eq!(rc, SUCCESS, "{name}");
    buf
}

fn read(lib: &Lib, src: u64, len: usize) -> Vec<u8> {
    read_with(lib, "cuMemcpyDtoH_v2", src, len)
}

fn sync(lib: &Lib) {
    // SAFETY: cuCtxSynchronize takes no arguments.
    let rc = unsafe { lib.f::<common::P0>("cuCtxSynchronize")() };
    assert_eq!(rc, SUCCESS);
}

fn pattern(first: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| first.wrapping_add(i as u8)).collect()
}

#[test]
fn host_copies_of_every_form_write_and_read_device_memory() {
    let lib = current();
    let ptr = alloc(lib, 1 << 20);
    for (i, (to_device, from_device)) in [
        ("cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2"),
        ("cuMemcpyHtoD_v2_ptds", "cuMemcpyDtoH_v2_ptds"),
        ("cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2"),
        ("cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz"),
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(i as u8 * 40 + 1, 1000);
        let at = ptr + 4096 * i as u64 + 3;
        write(lib, to_device, at, &data);
        sync(lib);
        assert_eq!(
            read_with(lib, from_device, at, data.len()),
            data,
            "{to_device}, then {from_device}"
        );
        assert_eq!(
            read(lib, at - 3, 3),
            vec![0; 3],
            "{to_device} wrote only its bytes"
        );
    }
}

#[test]
fn unwritten_memory_reads_as_zero_and_a_large_allocation_costs_only_what_was_written() {
    let lib = current();
    let bytes = 8usize << 30;
    let ptr = alloc(lib, bytes);
    assert_eq!(read(lib, ptr + (bytes as u64) - 16, 16), vec![0; 16]);
    write(
        lib,
        "cuMemcpyHtoD_v2",
        ptr + (4 << 30),
        &pattern(9, 1 << 20),
    );
    let disk: u64 = sim()
        .memory_images()
        .iter()
        .map(|name| {
            let path = sim().dir.path().join("memory").join(name);
            simgpu_model::contents::DeviceImage::disk_bytes(&path).unwrap()
        })
        .sum();
    assert!(
        disk < 64 << 20,
        "1 MiB written into 8 GiB takes {disk} bytes of disk"
    );
    assert_eq!(read(lib, ptr + (4 << 30) + 5, 3), vec![14, 15, 16]);
    // SAFETY: the allocation made above, freed once.
    assert_eq!(unsafe { lib.f::<P1<u64>>("cuMemFree_v2")(ptr) }, SUCCESS);
}

#[test]
fn device_to_device_copies_move_the_bytes() {
    let lib = current();
    // Over the driver's 4 MiB copy chunk.
    let len = (5 << 20) + 7;
    let (a, b) = (alloc(lib, len), alloc(lib, len));
    let data = pattern(33, len);
    write(lib, "cuMemcpyHtoD_v2", a, &data);
    for name in [
        "cuMemcpyDtoD_v2",
        "cuMemcpyDtoD_v2_ptds",
        "cuMemcpyDtoDAsync_v2",
        "cuMemcpyDtoDAsync_v2_ptsz",
    ] {
        // Cleared first, so each form must move the bytes itself.
        memset(lib, "cuMemsetD8Async", b, 0u8, len);
        assert_eq!(read(lib, b + 100, 4), vec![0; 4]);
        // SAFETY: two device allocations of `len` bytes.
        let rc = unsafe {
            if name.contains("Async") {
                lib.f::<P4<u64, u64, usize, usize>>(name)(b, a, len, 0)
            } else {
                lib.f::<P3<u64, u64, usize>>(name)(b, a, len)
            }
        };
        assert_eq!(rc, SUCCESS, "{name}");
        sync(lib);
        assert!(read(lib, b, len) == data, "{name} copied every byte");
    }
    // Copying memory never written zeroes the destination.
    let fresh = alloc(lib, 4096);
    // SAFETY: device allocations of at least 4096 bytes.
    let rc = unsafe { lib.f::<P3<u64, u64, usize>>("cuMemcpyDtoD_v2")(b, fresh, 4096) };
    assert_eq!(rc, SUCCESS);
    assert_eq!(read(lib, b, 4096), vec![0; 4096]);
    assert_eq!(read(lib, b + 4096, 2), data[4096..4098].to_vec());
}

/// Memset export `name` (a stream argument for the `Async` forms, the legacy stream) of
/// `count` elements `value` at `at`, then a synchronisation.
fn memset<T: Copy>(lib: &Lib, name: &str, at: u64, value: T, count: usize) {
    // SAFETY: the export's signature for an element of type T; the test's device memory.
    let rc = unsafe {
        if name.contains("Async") {
            lib.f::<P4<u64, T, usize, usize>>(name)(at, value, count, 0)
        } else {
            lib.f::<P3<u64, T, usize>>(name)(at, value, count)
        }
    };
    assert_eq!(rc, SUCCESS, "{name}");
    sync(lib);
}

#[test]
fn memsets_write_their_element_over_the_range() {
    let lib = current();
    let ptr = alloc(lib, 64 << 10);
    let d8 = [
        "cuMemsetD8_v2",
        "cuMemsetD8_v2_ptds",
        "cuMemsetD8Async",
        "cuMemsetD8Async_ptsz",
    ];
    for (i, name) in d8.into_iter().enumerate() {
        let (at, value) = (ptr + 1000 * i as u64 + 1, 0x10 + i as u8);
        memset(lib, name, at, value, 999);
        let got = read(lib, at - 1, 1001);
        assert_eq!(got[0], 0, "{name} starts at its address");
        assert!(got[1..1000].iter().all(|&b| b == value), "{name}");
        assert_eq!(got[1000], 0, "{name} stops at its count");
    }
    let d32 = [
        "cuMemsetD32_v2",
        "cuMemsetD32_v2_ptds",
        "cuMemsetD32Async",
        "cuMemsetD32Async_ptsz",
    ];
    for (i, name) in d32.into_iter().enumerate() {
        let at = ptr + (16 << 10) + 4096 * i as u64;
        let value: u32 = 0xdead_be00 | i as u32;
        memset(lib, name, at, value, 100);
        let got = read(lib, at, 404);
        assert_eq!(got[..400], value.to_ne_bytes().repeat(100), "{name}");
        assert_eq!(got[400..], [0; 4], "{name} stops at its count");
    }
}

#[test]
fn unified_copies_with_attributes_move_bytes_either_way() {
    let lib = current();
    let ptr = alloc(lib, 8192);
    let copy: P5<u64, u64, usize, *const c_void, usize> = lib.f("cuMemcpyWithAttributesAsync");
    let attributes = [0u8; 24];
    let data = pattern(101, 5000);
    let mut back = vec![0u8; 5000];
    // SAFETY: host buffers of 5000 bytes, a device allocation of 8192, zeroed attributes.
    unsafe {
        let host_src = data.as_ptr() as u64;
        let host_dst = back.as_mut_ptr() as u64;
        let attr = attributes.as_ptr().cast();
        assert_eq!(copy(ptr + 10, host_src, 5000, attr, 0), SUCCESS);
        assert_eq!(copy(host_dst, ptr + 10, 5000, attr, 0), SUCCESS);
    }
    sync(lib);
    assert_eq!(back, data);
}

/// `CUmemAllocationProp` of device memory on device 0.
#[repr(C)]
struct AllocationProp {
    alloc_type: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32: *mut c_void,
    flags: [u8; 8],
}

#[test]
fn mapped_virtual_memory_holds_data_by_address() {
    let lib = current();
    let size = 2usize << 20;
    let prop = AllocationProp {
        alloc_type: 1,
        handle_types: 0,
        location_type: 1,
        location_id: 0,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    };
    let (mut handle, mut va) = (0u64, 0u64);
    // SAFETY: live out-pointers, a CUmemAllocationProp that outlives the calls, a range the
    // reservation covers.
    unsafe {
        let create: P4<*mut u64, usize, *const AllocationProp, u64> = lib.f("cuMemCreate");
        assert_eq!(create(&mut handle, size, &prop, 0), SUCCESS);
        let reserve: P5<*mut u64, usize, usize, u64, u64> = lib.f("cuMemAddressReserve");
        assert_eq!(reserve(&mut va, size, 0, 0, 0), SUCCESS);
        let map: P5<u64, usize, usize, u64, u64> = lib.f("cuMemMap");
        assert_eq!(map(va, size, 0, handle, 0), SUCCESS);
    }
    let data = pattern(250, 3 << 10);
    write(lib, "cuMemcpyHtoD_v2", va + (1 << 20), &data);
    assert_eq!(read(lib, va + (1 << 20), data.len()), data);
    assert_eq!(read(lib, va, 8), vec![0; 8], "unwritten");
}
