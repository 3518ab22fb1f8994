package host

import (
	"context"
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A Harvester without the VolumeRemoteBackup kind answers 404 to the
// create; that must not read as "the volume does not exist".
func TestCreateBackupOnAHostWithoutTheKind(t *testing.T) {
	kube := kubefake.NewClientset(&corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pvc-a", Namespace: "guests"}})
	dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		BackupResource: "VolumeRemoteBackupList", snapshotResource: "VolumeSnapshotList",
	})
	dyn.PrependReactor("create", BackupResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewNotFound(schema.GroupResource{}, "")
	})
	c := &Client{Namespace: "guests", Kube: kube, Dynamic: dyn}
	_, err := c.CreateBackup(context.Background(), "snapshot-1", "pvc-a")
	var notServed *NotServedError
	if !errors.As(err, &notServed) {
		t.Fatalf("CreateBackup: %v, want a NotServedError", err)
	}
}

func TestBackupStatus(t *testing.T) {
	obj := func(status map[string]any) *unstructured.Unstructured {
		return &unstructured.Unstructured{Object: map[string]any{
			"metadata": map[string]any{"name": "b", "namespace": "guests"},
			"spec":     map[string]any{"type": "lh", "source": "pvc-a"},
			"status":   status,
		}}
	}
	cond := func(status, msg string) []any {
		return []any{map[string]any{"type": "Ready", "status": status, "message": msg}}
	}
	for _, c := range []struct {
		name     string
		status   map[string]any
		complete bool
		err      string
		bytes    int64
	}{
		{"new", nil, false, "", 0},
		{"in progress", map[string]any{"conditions": cond("False", inProgressMessage)}, false, "", 0},
		{"error", map[string]any{"conditions": cond("False", "no backup target")}, false, "no backup target", 0},
		{"complete", map[string]any{"success": true, "conditions": cond("True", "Operation complete"),
			"sourceSpec": map[string]any{"resources": map[string]any{"requests": map[string]any{"storage": "64Mi"}}}}, true, "", 64 << 20},
	} {
		b := backupFrom(obj(c.status))
		if b.Complete != c.complete || b.Error != c.err || b.Bytes != c.bytes || b.SourceVolume != "pvc-a" || b.Ref() != "guests/b" {
			t.Errorf("%s: %+v", c.name, b)
		}
	}
}

// nameRaceHost is a host with the volume pvc-a and both kinds served.
func nameRaceHost() (*Client, *dynfake.FakeDynamicClient) {
	kube := kubefake.NewClientset(&corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "pvc-a", Namespace: "guests"}})
	dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		BackupResource: "VolumeRemoteBackupList", snapshotResource: "VolumeSnapshotList", settingResource: "SettingList",
	})
	return &Client{Namespace: "guests", Kube: kube, Dynamic: dyn}, dyn
}

func raceObject(gvr schema.GroupVersionResource, kind, name string) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": gvr.GroupVersion().String(), "kind": kind,
		"metadata": map[string]any{"name": name, "namespace": "guests"},
		"spec":     map[string]any{"source": map[string]any{"persistentVolumeClaimName": "pvc-a"}},
	}}
}

// A backup of the name created between the host snapshot's two checks wins:
// the snapshot side deletes its own snapshot and answers that the name is
// taken.
func TestHostSnapshotWithdrawsForABackupOfItsName(t *testing.T) {
	c, dyn := nameRaceHost()
	dyn.PrependReactor("create", snapshotResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		// Another controller's backup lands right after this create.
		err := dyn.Tracker().Create(BackupResource, raceObject(BackupResource, BackupKind, "snap-1"), "guests")
		return false, nil, err
	})
	_, err := c.CreateSnapshot(context.Background(), "snap-1", "pvc-a")
	var taken *BackupMismatchError
	if !errors.As(err, &taken) {
		t.Fatalf("CreateSnapshot with a backup of its name created meanwhile: %v, want a BackupMismatchError", err)
	}
	if _, err := dyn.Resource(snapshotResource).Namespace("guests").Get(context.Background(), "snap-1", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the host snapshot that lost its name is still there: %v", err)
	}
	if _, err := dyn.Resource(BackupResource).Namespace("guests").Get(context.Background(), "snap-1", metav1.GetOptions{}); err != nil {
		t.Errorf("the backup that won is gone: %v", err)
	}
}

// A host snapshot of the name created between the backup's two checks, that
// then withdraws (its side saw the backup), leaves the backup the winner.
func TestBackupWinsWhenTheHostSnapshotWithdraws(t *testing.T) {
	c, dyn := nameRaceHost()
	dyn.PrependReactor("create", BackupResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		err := dyn.Tracker().Create(snapshotResource, raceObject(snapshotResource, "VolumeSnapshot", "snap-2"), "guests")
		return false, nil, err
	})
	gets := 0
	dyn.PrependReactor("get", snapshotResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		if gets++; gets == 3 { // the snapshot side withdraws while the backup waits
			return false, nil, dyn.Tracker().Delete(snapshotResource, "guests", "snap-2")
		}
		return false, nil, nil
	})
	b, err := c.CreateBackup(context.Background(), "snap-2", "pvc-a")
	if err != nil || b.Name != "snap-2" {
		t.Fatalf("CreateBackup whose rival host snapshot withdrew: %v, %v; want the backup", b, err)
	}
	if _, err := dyn.Resource(BackupResource).Namespace("guests").Get(context.Background(), "snap-2", metav1.GetOptions{}); err != nil {
		t.Errorf("the backup that won is gone: %v", err)
	}
}

// A read that fails while the backup waits for its rival host snapshot to
// withdraw does not decide the race. client-go's rate limiter, for one,
// refuses a wait that would pass the wait's bound ("client rate limiter Wait
// returned an error: rate: Wait(n=1) would exceed context deadline"), which
// is not a context error; the backup then deleted itself and answered
// Internal although the snapshot withdrew.
func TestBackupWaitOutlastsAFailedRead(t *testing.T) {
	c, dyn := nameRaceHost()
	dyn.PrependReactor("create", BackupResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		err := dyn.Tracker().Create(snapshotResource, raceObject(snapshotResource, "VolumeSnapshot", "snap-3"), "guests")
		return false, nil, err
	})
	gets := 0
	dyn.PrependReactor("get", snapshotResource.Resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		switch gets++; gets {
		case 3, 4:
			return true, nil, errors.New("client rate limiter Wait returned an error: rate: Wait(n=1) would exceed context deadline")
		case 5: // the snapshot side withdraws
			return false, nil, dyn.Tracker().Delete(snapshotResource, "guests", "snap-3")
		}
		return false, nil, nil
	})
	b, err := c.CreateBackup(context.Background(), "snap-3", "pvc-a")
	if err != nil || b.Name != "snap-3" {
		t.Fatalf("CreateBackup whose rival withdrew after two failed reads: %v, %v; want the backup", b, err)
	}
	if _, err := dyn.Resource(BackupResource).Namespace("guests").Get(context.Background(), "snap-3", metav1.GetOptions{}); err != nil {
		t.Errorf("the backup that won is gone: %v", err)
	}
}
