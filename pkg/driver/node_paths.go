package driver

import (
	"sync"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

// pathBook maps paths this process mounted to their volume.
type pathBook struct {
	mu    sync.Mutex
	paths map[string]string
}

func newPathBook() *pathBook { return &pathBook{paths: map[string]string{}} }

func (b *pathBook) add(volumeID, path string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.paths[mountinfo.Canonical(path)] = volumeID
}

func (b *pathBook) remove(path string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.paths, mountinfo.Canonical(path))
}

func (b *pathBook) owner(path string) (string, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	v, ok := b.paths[mountinfo.Canonical(path)]
	return v, ok
}

// pathsOf lists the paths recorded for volumeID.
func (b *pathBook) pathsOf(volumeID string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for p, v := range b.paths {
		if v == volumeID {
			out = append(out, p)
		}
	}
	return out
}
