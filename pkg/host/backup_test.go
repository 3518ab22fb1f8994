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
