package guest

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

type fakeVMs struct {
	mu       sync.Mutex
	views    map[string]hotplug.VMView
	detached []string
}

func (f *fakeVMs) Synced() bool { return true }

func (f *fakeVMs) View(vm string) hotplug.VMView {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.views[vm]
}

func (f *fakeVMs) Detach(_ context.Context, vm, volume string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detached = append(f.detached, vm+"/"+volume)
	return nil
}

func readyNode(name string, ready corev1.ConditionStatus, tainted bool) *corev1.Node {
	n := guestNode(name)
	if ready != "" {
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready}}
	}
	n.Spec.Taints = []corev1.Taint{{Key: "keep-me", Effect: corev1.TaintEffectNoSchedule}}
	if tainted {
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeOutOfService, Effect: corev1.TaintEffectNoExecute})
	}
	return n
}

// Each decision of upstream's node controller, and the cases it must leave
// alone, on a guest Node whose name differs from its VM's.
func TestMonitorDecisions(t *testing.T) {
	running := hotplug.VMView{Exists: true, Running: true, Volumes: []string{"pvc-a"}}
	stopped := hotplug.VMView{Exists: true, Volumes: []string{"pvc-a", "pvc-b"}}
	for _, tc := range []struct {
		name        string
		ready       corev1.ConditionStatus
		tainted     bool
		vm          hotplug.VMView
		wantTainted bool
		wantDetach  []string
	}{
		{name: "NotReady on a stopped VM is tainted", ready: corev1.ConditionFalse, vm: stopped, wantTainted: true},
		{name: "Unknown (kubelet silent) on a stopped VM is tainted", ready: corev1.ConditionUnknown, vm: stopped, wantTainted: true},
		{name: "tainted NotReady on a stopped VM loses its volumes", ready: corev1.ConditionFalse, tainted: true, vm: stopped, wantTainted: true, wantDetach: []string{"vm-1/pvc-a", "vm-1/pvc-b"}},
		{name: "Ready on a running VM loses the taint", ready: corev1.ConditionTrue, tainted: true, vm: running},
		{name: "NotReady on a running VM is left alone (a partition, not a dead VM)", ready: corev1.ConditionFalse, vm: running},
		{name: "tainted NotReady on a running VM keeps its taint and volumes", ready: corev1.ConditionFalse, tainted: true, vm: running, wantTainted: true},
		{name: "Ready on a stopped VM (stale status) is left alone", ready: corev1.ConditionTrue, vm: stopped},
		{name: "a Node whose VM the host does not show is left alone", ready: corev1.ConditionFalse, vm: hotplug.VMView{}},
		{name: "a Node without Ready condition is left alone", vm: stopped},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			nodes, client := startNodes(t, readyNode("worker-1", tc.ready, tc.tainted), csiNode("worker-1", "vm-1"))
			vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": tc.vm}}
			ev := &fakeEvents{}
			m, err := NewMonitor(MonitorConfig{}, client, nodes, vms, ev)
			if err != nil {
				t.Fatal(err)
			}
			if err := m.sync(ctx, "worker-1"); err != nil {
				t.Fatal(err)
			}
			n, err := client.CoreV1().Nodes().Get(ctx, "worker-1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if got := OutOfService(n); got != tc.wantTainted {
				t.Errorf("tainted = %v, want %v (taints %+v)", got, tc.wantTainted, n.Spec.Taints)
			}
			if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == "keep-me" }) {
				t.Errorf("another taint was lost: %+v", n.Spec.Taints)
			}
			if tc.wantTainted && !tc.tainted {
				i := slices.IndexFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeOutOfService })
				if got := n.Spec.Taints[i]; got.Value != "nodeshutdown" || got.TimeAdded == nil {
					t.Errorf("taint %+v, want node.kubernetes.io/out-of-service=nodeshutdown:NoExecute with its time", got)
				}
			}
			slices.Sort(vms.detached) // detached concurrently, in any order
			if !slices.Equal(vms.detached, tc.wantDetach) {
				t.Errorf("detached %v, want %v", vms.detached, tc.wantDetach)
			}
			changed := tc.wantTainted != tc.tainted || len(tc.wantDetach) > 0
			if got := ev.list(); changed != (len(got) == 1) || len(got) > 1 {
				t.Errorf("events %+v (a change gets one, nothing else any)", got)
			} else if changed && (got[0].node != "worker-1" || !strings.Contains(got[0].message, "vm-1")) {
				t.Errorf("event %+v does not name the VM on the node", got[0])
			}
		})
	}
}
