//! Opaque handles (`CUcontext`, `CUstream`, ...) as tagged slab indices.
//!
//! The values are never dereferenced by anyone: a program that hands back a handle of the
//! wrong kind, or one already destroyed, gets `CUDA_ERROR_INVALID_HANDLE` instead of a crash.
//! Tags keep the values far from `CU_STREAM_LEGACY` (0x1) and `CU_STREAM_PER_THREAD` (0x2).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Context = 1,
    Stream = 2,
    Event = 3,
    Module = 4,
    Function = 5,
    Graph = 6,
    GraphExec = 7,
    Array = 8,
    MipmappedArray = 9,
    MemPool = 10,
    /// A node of a graph (`api::graph`): its graph's index and its own, not a slab's.
    GraphNode = 11,
}

pub const TAG_SHIFT: u32 = 40;

pub struct Slab<T> {
    kind: Kind,
    items: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Slab<T> {
    pub const fn new(kind: Kind) -> Slab<T> {
        Slab {
            kind,
            items: Vec::new(),
            free: Vec::new(),
        }
    }

    pub fn insert(&mut self, item: T) -> usize {
        let index = match self.free.pop() {
            Some(i) => {
                self.items[i] = Some(item);
                i
            }
            None => {
                self.items.push(Some(item));
                self.items.len() - 1
            }
        };
        ((self.kind as usize) << TAG_SHIFT) | (index + 1)
    }

    fn index(&self, handle: usize) -> Option<usize> {
        if handle >> TAG_SHIFT != self.kind as usize {
            return None;
        }
        let index = (handle & ((1 << TAG_SHIFT) - 1)).checked_sub(1)?;
        self.items.get(index)?.as_ref().map(|_| index)
    }

    pub fn get(&self, handle: usize) -> Option<&T> {
        self.index(handle).and_then(|i| self.items[i].as_ref())
    }

    pub fn get_mut(&mut self, handle: usize) -> Option<&mut T> {
        self.index(handle).and_then(|i| self.items[i].as_mut())
    }

    pub fn remove(&mut self, handle: usize) -> Option<T> {
        let i = self.index(handle)?;
        self.free.push(i);
        self.items[i].take()
    }

    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        let tag = (self.kind as usize) << TAG_SHIFT;
        self.items
            .iter()
            .enumerate()
            .filter_map(move |(i, t)| t.as_ref().map(|t| (tag | (i + 1), t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_typed_and_die_with_their_object() {
        let mut streams = Slab::new(Kind::Stream);
        let events: Slab<u32> = Slab::new(Kind::Event);
        let h = streams.insert(7u32);
        assert!(h > 2, "never collides with CU_STREAM_LEGACY / PER_THREAD");
        assert_eq!(streams.get(h), Some(&7));
        assert_eq!(events.get(h), None, "a stream handle is not an event");
        assert_eq!(streams.remove(h), Some(7));
        assert_eq!(streams.get(h), None);
        assert_eq!(streams.get(0), None);
        assert_eq!(streams.remove(h), None);
    }
}
