package hotplug

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// gatedReader lists the VMs it holds at the moment of the call; the first
// call then waits for release before it answers.
type gatedReader struct {
	mu      sync.Mutex
	vms     []string
	calls   int
	entered chan struct{}
	release chan struct{}
}

func (g *gatedReader) ListVMs(context.Context) ([]kubevirtv1.VirtualMachine, error) {
	g.mu.Lock()
	g.calls++
	first := g.calls == 1
	out := make([]kubevirtv1.VirtualMachine, len(g.vms))
	for i, n := range g.vms {
		out[i].Name = n
	}
	g.mu.Unlock()
	if first {
		close(g.entered)
		<-g.release
	}
	return out, nil
}

func (g *gatedReader) ListVMIs(context.Context) ([]kubevirtv1.VirtualMachineInstance, error) {
	return nil, nil
}
func (g *gatedReader) VMExists(context.Context, string) (bool, error) { return true, nil }
func (g *gatedReader) LiveLaunchers(context.Context, string, types.UID) (map[types.UID]bool, error) {
	return nil, nil
}
func (g *gatedReader) WakeVM(context.Context, string, time.Time) error { return nil }
func (g *gatedReader) Claim(context.Context, string) (HostClaim, error) {
	return HostClaim{Phase: corev1.ClaimBound, Exists: true}, nil
}
func (g *gatedReader) Reserve(_ context.Context, from HostClaim, r Reservation) (HostClaim, error) {
	from.Reserved = r
	return from, nil
}

// Workers that ask while a live read is under way share the next read, and
// each gets a read begun after it asked: a VM created after the first read
// began is in every later worker's answer.
func TestLiveReadsAreSharedButNeverOlderThanTheAsk(t *testing.T) {
	g := &gatedReader{vms: []string{"vm1"}, entered: make(chan struct{}), release: make(chan struct{})}
	l := &liveReads{reader: g, timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	first := make(chan *liveRead, 1)
	go func() {
		r, err := l.get(ctx)
		if err != nil {
			t.Error(err)
		}
		first <- r
	}()
	<-g.entered // the first read has listed vm1 alone and not answered yet
	g.mu.Lock()
	g.vms = append(g.vms, "vm2")
	g.mu.Unlock()

	const later = 8
	answers := make(chan *liveRead, later)
	for range later {
		go func() {
			r, err := l.get(ctx)
			if err != nil {
				t.Error(err)
			}
			answers <- r
		}()
	}
	testwait.UntilEvery(ctx, t, time.Millisecond, fmt.Sprintf("%d workers waiting for the next read", later), func() (bool, string) {
		l.mu.Lock()
		n := l.joined
		l.mu.Unlock()
		return n == later, fmt.Sprintf("%d waiting", n)
	})
	close(g.release)

	if r := <-first; len(r.vms) != 1 {
		t.Errorf("the first read saw %d VMs, want 1", len(r.vms))
	}
	for range later {
		if r := <-answers; len(r.vms) != 2 {
			t.Errorf("a worker that asked after vm2 was created got a read of %d VMs, want 2", len(r.vms))
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.calls != 2 {
		t.Errorf("%d lists for 1+%d workers, want 2", g.calls, later)
	}
}
