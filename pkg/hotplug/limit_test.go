package hotplug

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

// At KubeVirt's limit of 256 disks an attach is answered VMFullError and
// never written (the API server would refuse the whole write, the batch's
// other changes with it); a removal in the same batch makes room, and adds
// this process wrote that the informers do not show yet count.
func TestDecideStopsAtTheDiskLimit(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var vols []string
	for i := range MaxVMDisks - 1 { // root, cloud-init and 253 hot-plugged
		vols = append(vols, fmt.Sprintf("disk-%03d", i))
	}
	for _, tc := range []struct {
		name        string
		intents     map[string]Op
		expect      map[string]expectation
		wantChanges []Change
		wantFull    []string
	}{
		{name: "the 256th fits, the 257th does not",
			intents:     map[string]Op{"a": Attach, "b": Attach},
			wantChanges: []Change{{Volume: "a", Op: Attach}},
			wantFull:    []string{"b"}},
		{name: "a removal in the batch makes room",
			intents:     map[string]Op{"a": Attach, "b": Attach, "disk-200": Detach},
			wantChanges: []Change{{Volume: "disk-200", Op: Detach}, {Volume: "a", Op: Attach}, {Volume: "b", Op: Attach}}},
		{name: "an add written but not shown yet counts",
			intents:  map[string]Op{"a": Attach, "b": Attach},
			expect:   map[string]expectation{"a": {op: Attach, since: t0}},
			wantFull: []string{"b"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := &vmWork{intents: map[string]*intent{}, expect: map[string]expectation{}}
			for v, op := range tc.intents {
				w.intents[v] = &intent{vm: "vm1", volume: v, op: op, created: t0}
			}
			for v, e := range tc.expect {
				w.expect[v] = e
			}
			p := decide(t0, Config{MaxHold: 30 * time.Second, MaxDisks: MaxVMDisks}, w, facts{o: observed{vm: vmWith(vols)}})
			if !slices.Equal(p.changes, tc.wantChanges) {
				t.Errorf("changes %v, want %v", p.changes, tc.wantChanges)
			}
			var full []string
			for _, r := range p.resolve {
				var e *VMFullError
				if !errors.As(r.err, &e) || !errors.Is(r.err, ErrVMFull) || e.Limit != MaxVMDisks || e.Disks != MaxVMDisks {
					t.Errorf("volume %s answered %v, want a VMFullError at %d of %d disks", r.it.volume, r.err, MaxVMDisks, MaxVMDisks)
				}
				full = append(full, r.it.volume)
			}
			if !slices.Equal(full, tc.wantFull) {
				t.Errorf("refused %v, want %v", full, tc.wantFull)
			}
		})
	}
}
