package rbac

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"path"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// TestControllerRWXCallsFitTheListedPermissions: an RWX unpublish asks the
// guest whether pods still use the volume's claim (the volume's PV, read by
// name and, for a volume whose ID is not its PV's name, found among all PVs;
// the pod cache; a fresh list of the claim's namespace) with only the
// controller's listed permissions, and every guest cache it reads (the
// shared PV cache included) is allowed its watch.
func TestControllerRWXCallsFitTheListedPermissions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	env, admin := g.Env, g.Kube
	for _, pv := range []struct{ name, handle, claim string }{{"pvc-rwx", "pvc-rwx", "shared"}, {"renamed-pv", "vol-other", "other"}} {
		if _, err := admin.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: pv.name},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:               corev1.ResourceList{corev1.ResourceStorage: *resourceQuantity("1Gi")},
				AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
				ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "default", Name: pv.claim},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.Name, VolumeHandle: pv.handle}},
			},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []struct{ name, claim string }{{"app-1", "shared"}, {"app-2", "other"}} {
		if _, err := admin.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name},
			Spec: corev1.PodSpec{NodeName: "rke2-worker-1", Containers: []corev1.Container{{Name: "c", Image: "app"}},
				Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: p.claim}}}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	pvName := "pvc-rwx"
	if _, err := admin.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-pvc-rwx-worker-1"},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: "rke2-worker-1",
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	user := "system:serviceaccount:kube-system:harvester-csi-driver"
	asUser(t, ctx, env.Config, user, rulesFor(t, "controller"))
	// An informer whose watch is refused still syncs (from its list) and
	// lists again and again: only the watch's own answer shows the refusal.
	watches := &watchAnswers{got: map[string]int{}}
	cfg := rest.CopyConfig(env.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user}
	cfg.Wrap(watches.wrap)
	client := kubernetes.NewForConfigOrDie(cfg)
	nodes, err := guest.NewNodes(client, driver.Name, 0)
	if err != nil {
		t.Fatal(err)
	}
	claims, err := guest.NewClaims(client, driver.Name, nodes)
	if err != nil {
		t.Fatal(err)
	}
	nodes.Start(ctx.Done())
	claims.Start(ctx.Done())
	syncCtx, syncCancel := context.WithTimeout(ctx, time.Minute)
	defer syncCancel()
	testwait.Until(syncCtx, t, "the guest caches to sync with the listed permissions (list/watch of pods, nodes, csinodes, volumeattachments or persistentvolumes refused)",
		testwait.Bool(func() bool { return nodes.HasSynced() && claims.Synced() }))
	informed := []string{"nodes", "csinodes", "volumeattachments", "persistentvolumes", "pods"}
	testwait.Until(syncCtx, t, "the caches' watches to be answered", func() (bool, string) {
		got := watches.answers()
		return len(got) >= len(informed), fmt.Sprint(got)
	})
	for _, res := range informed {
		if code := watches.answers()[res]; code != http.StatusOK {
			t.Errorf("watch of %s answered %d with the listed permissions, want 200", res, code)
		}
	}
	for _, c := range []struct{ volume, want string }{{"pvc-rwx", "default/app-1 on rke2-worker-1"}, {"vol-other", "default/app-2 on rke2-worker-1"}} {
		for _, fresh := range []bool{false, true} {
			users, err := claims.Users(ctx, c.volume, fresh)
			if err != nil || len(users) != 1 || users[0] != c.want {
				t.Errorf("users of %s (fresh %t) with the listed permissions: %v, %v; want [%s]", c.volume, fresh, users, err, c.want)
			}
		}
	}
	// Where an RWX volume is published: its VolumeAttachments, cached and
	// listed afresh.
	for _, fresh := range []bool{false, true} {
		atts, err := claims.Attachments(ctx, "pvc-rwx", fresh)
		if err != nil || len(atts) != 1 || atts[0].Node != "rke2-worker-1" {
			t.Errorf("attachments of pvc-rwx (fresh %t) with the listed permissions: %v, %v; want the one on rke2-worker-1", fresh, atts, err)
		}
	}
}

// watchAnswers records the status of the last watch request the client sent
// for each resource.
type watchAnswers struct {
	mu  sync.Mutex
	got map[string]int
}

func (w *watchAnswers) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		resp, err := rt.RoundTrip(req)
		if err == nil && req.URL.Query().Get("watch") == "true" {
			w.mu.Lock()
			w.got[path.Base(req.URL.Path)] = resp.StatusCode
			w.mu.Unlock()
		}
		return resp, err
	})
}

func (w *watchAnswers) answers() map[string]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.got)
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }
