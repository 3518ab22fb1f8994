package kubevirtsim

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
)

// cloneHookLog is a DiskHook that also implements CloneHook and records the
// clones.
type cloneHookLog struct {
	mu     sync.Mutex
	clones []string
}

var (
	_ CloneHook = (*cloneHookLog)(nil)
	_ CloneHook = (*loopdisk.LoopDisks)(nil)
)

func (h *cloneHookLog) Plug(context.Context, string, string, string) error { return nil }
func (h *cloneHookLog) Unplug(context.Context, string, string) error       { return nil }

func (h *cloneHookLog) Clone(_ context.Context, source, claim string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.clones = append(h.clones, source+" -> "+claim)
	return nil
}

func (h *cloneHookLog) get() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.clones)
}

// clonePVC creates a claim of the provisioner's class cloned from source.
func clonePVC(ctx context.Context, t *testing.T, s *Sim, ns, name, source, size string, mode corev1.PersistentVolumeMode) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(mode),
			StorageClassName: ptr.To(s.c.opts.StorageClass),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
			DataSource:       &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: source},
		},
	}
	out, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestClones is the clone contract: a claim whose data source is another
// claim stays Pending while external-provisioner or Longhorn would refuse
// it (the source missing, another volume mode, another size after Longhorn's
// 2 MiB rounding), binds once it can, and the hook copies the data once,
// before the bind.
func TestClones(t *testing.T) {
	t.Parallel()
	hook := &cloneHookLog{}
	s, ns := testSim(t, Options{DiskHook: hook})
	ctx := testCtx(t, 60*time.Second)
	// Just under 1 GiB: Longhorn's volume is 1 GiB.
	if _, err := s.CreatePVC(ctx, ns, "src", "1073741000", false); err != nil {
		t.Fatal(err)
	}

	bigger := clonePVC(ctx, t, s, ns, "bigger", "src", "2Gi", corev1.PersistentVolumeBlock)
	waitRestoreGate(ctx, t, s, bigger, "failed to clone volume: the requested size (2147483648 bytes) is different than the source volume size (1073741824 bytes)")
	otherMode := clonePVC(ctx, t, s, ns, "fs", "src", "1Gi", corev1.PersistentVolumeFilesystem)
	waitRestoreGate(ctx, t, s, otherMode, "must have the same volume mode for cloning.  Source is Block, but new PVC requested Filesystem")
	early := clonePVC(ctx, t, s, ns, "early", "late", "1Gi", corev1.PersistentVolumeBlock)
	waitRestoreGate(ctx, t, s, early, `error getting PVC late`)

	// Within Longhorn's rounding is the same size.
	clonePVC(ctx, t, s, ns, "same", "src", "1Gi", corev1.PersistentVolumeBlock)
	waitBound(ctx, t, s, ns, "same")
	// A source that appears frees its clone.
	if _, err := s.CreatePVC(ctx, ns, "late", "1Gi", false); err != nil {
		t.Fatal(err)
	}
	waitBound(ctx, t, s, ns, "early")

	if got, want := hook.get(), []string{"src -> same", "late -> early"}; !slices.Equal(got, want) {
		t.Errorf("clones %q, want %q", got, want)
	}
	for _, name := range []string{"bigger", "fs"} {
		cur, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || cur.Status.Phase != corev1.ClaimPending {
			t.Errorf("refused clone %s: %v, phase %s", name, err, cur.Status.Phase)
		}
	}
}
