package guest

import (
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// pvReads lists the guest PV reads (get, list) the client sent to the API
// server since its actions were last cleared, as verb and list options.
func pvReads(client *fake.Clientset) []string {
	var out []string
	for _, a := range client.Actions() {
		if a.GetResource().Resource != "persistentvolumes" {
			continue
		}
		switch a := a.(type) {
		case k8stesting.ListActionImpl:
			out = append(out, "list rv="+a.ListOptions.ResourceVersion)
		case k8stesting.GetAction:
			out = append(out, "get "+a.GetName())
		}
	}
	return out
}

// The reconciler's sweep, which runs every Interval while any hot-plug is
// held, reads which volumes are this cluster's from the shared PV cache;
// only the removal of a candidate reads the PVs from the API server.
func TestOrphanSweepReadsPVsFromTheCache(t *testing.T) {
	r, nodes := newOrphanRig(t, map[string][]string{"vm-1": {"pvc-a"}}, guestNode("worker-1"), csiNode("worker-1", "vm-1"), guestPV("pvc-a"))
	client := nodes.client.(*fake.Clientset)
	client.ClearActions()
	r.sweep(t, 0, leaseUntil)
	if got := testutil.ToFloat64(r.o.seen); got != 1 {
		t.Fatalf("orphans seen %v, want 1: the test checks nothing", got)
	}
	if got := pvReads(client); len(got) > 0 {
		t.Errorf("a sweep read the guest PVs from the API server: %v", got)
	}
	client.ClearActions()
	r.sweep(t, 2*time.Minute, leaseUntil)
	if got := r.vms.gone(); !slices.Equal(got, []string{"vm-1/pvc-a"}) {
		t.Fatalf("removed %v, want vm-1/pvc-a", got)
	}
	// The removal's own check is a quorum list (no resourceVersion).
	if got := pvReads(client); !slices.Equal(got, []string{"list rv="}) {
		t.Errorf("PV reads of the removal %v, want one quorum list", got)
	}
}

// The monitor's release of a fenced Node's volumes tells this cluster's
// volumes from the shared PV cache, without a read of the API server.
func TestMonitorReleaseReadsPVsFromTheCache(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	stopped := hotplug.VMView{Exists: true, Guest: hotplug.GuestAbsent, Volumes: []string{"pvc-a", "pvc-theirs"}}
	nodes, client := startNodes(t, readyNode("worker-1", corev1.ConditionFalse, true), csiNode("worker-1", "vm-1"),
		heldLease("replica-a", time.Now()), guestPV("pvc-a"))
	vms := &fakeVMs{views: map[string]hotplug.VMView{"vm-1": stopped}}
	m, err := NewMonitor(MonitorConfig{Identity: "replica-a"}, client, nodes, vms, nil)
	if err != nil {
		t.Fatal(err)
	}
	client.ClearActions()
	if err := m.sync(newTerm(ctx, func(error) {}), "worker-1"); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(vms.detached, []string{"vm-1/pvc-a"}) {
		t.Errorf("detached %v, want vm-1/pvc-a", vms.detached)
	}
	if got := pvReads(client); len(got) > 0 {
		t.Errorf("the release read the guest PVs from the API server: %v", got)
	}
}

// startClaims runs the RWX caches over client.
func startClaims(t *testing.T, client *fake.Clientset) *Claims {
	t.Helper()
	nodes := startNodesOn(t, client)
	claims, err := NewClaims(client, testDriver, nodes)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	claims.Start(stop)
	testwait.For(t, "the RWX caches to sync", 10*time.Second, claims.Synced)
	return claims
}

// The cached RWX answers (where a volume is published, which pods use its
// claim) find the volume's guest PV in the shared cache, by name or by its
// handle; the fresh ones, which confirm an export may be disabled, read it
// from the API server.
func TestClaimsReadPVsFromTheCacheUnlessFresh(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	renamed := guestPV("renamed-pv")
	renamed.Spec.CSI.VolumeHandle = "vol-other"
	pods := []runtime.Object{}
	for pv, claim := range map[*corev1.PersistentVolume]string{guestPV("pvc-rwx"): "shared", renamed: "other"} {
		pv.Spec.ClaimRef = &corev1.ObjectReference{Namespace: "default", Name: claim}
		pods = append(pods, pv, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "app-" + claim},
			Spec: corev1.PodSpec{NodeName: "worker-1", Volumes: []corev1.Volume{{Name: "data",
				VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}}})
	}
	client := fake.NewClientset(append(pods, guestNode("worker-1"), csiNode("worker-1", "vm-1"), attachment("pvc-rwx", "worker-1", "vm-1"))...)
	claims := startClaims(t, client)
	for _, c := range []struct{ volume, user string }{{"pvc-rwx", "default/app-shared on worker-1"}, {"vol-other", "default/app-other on worker-1"}} {
		client.ClearActions()
		users, err := claims.Users(ctx, c.volume, false)
		if err != nil || !slices.Equal(users, []string{c.user}) {
			t.Errorf("cached users of %s: %v, %v; want [%s]", c.volume, users, err, c.user)
		}
		atts, err := claims.Attachments(ctx, c.volume, false)
		if err != nil {
			t.Errorf("cached attachments of %s: %v", c.volume, err)
		}
		if c.volume == "pvc-rwx" && (len(atts) != 1 || atts[0].VM != "vm-1") {
			t.Errorf("cached attachments of pvc-rwx: %v, want the one on vm-1", atts)
		}
		if got := pvReads(client); len(got) > 0 {
			t.Errorf("cached answers for %s read the guest PVs from the API server: %v", c.volume, got)
		}
		client.ClearActions()
		users, err = claims.Users(ctx, c.volume, true)
		if err != nil || !slices.Equal(users, []string{c.user}) {
			t.Errorf("fresh users of %s: %v, %v; want [%s]", c.volume, users, err, c.user)
		}
		if got := pvReads(client); len(got) == 0 {
			t.Errorf("the fresh answer for %s did not read the guest PV from the API server", c.volume)
		}
	}
}
