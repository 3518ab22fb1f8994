package testenv

import (
	"context"
	"fmt"
	"time"

	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// InstallCRDs creates the CRDs that are missing (an existing one is kept as
// it is) and returns once all are Established: a client that creates an
// object of a CRD that is not yet served gets NotFound.
func InstallCRDs(ctx context.Context, ext apiextclient.Interface, list []*apiextv1.CustomResourceDefinition) error {
	crds := ext.ApiextensionsV1().CustomResourceDefinitions()
	for _, c := range list {
		if _, err := crds.Create(ctx, c, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create CRD %s: %w", c.Name, err)
		}
	}
	for _, c := range list {
		err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			got, err := crds.Get(ctx, c.Name, metav1.GetOptions{})
			if err != nil {
				return false, nil //nolint:nilerr // not visible yet: ask again
			}
			for _, cond := range got.Status.Conditions {
				if cond.Type == apiextv1.Established && cond.Status == apiextv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("CRD %s not established: %w", c.Name, err)
		}
	}
	return nil
}
